// The OpenID provider fleetline's sign-in tests and lab run: node-oidc-provider (a certified
// OpenID Connect implementation) with a login page that asks for a password and, for users
// who have one, a one-time code. What an enterprise IdP asserts is what this one asserts:
// `amr` is ["pwd"] after a password alone and ["pwd", "otp", "mfa"] after the second factor,
// and the id token carries the `fleetline_role` and `tenant` claims of the `fleetline` scope.
//
//   node provider.mjs CONFIG.json
//
// CONFIG (written by fleetline/infra/oidc.py): {issuer, port, jwks: {keys: [private JWKs]},
// cookie_keys: [...], clients: [...], users: {name: {password, otp?, role, tenant?}}}.
// The first key signs; the others are still published (a rotation's overlap).
import fs from "node:fs";
import http from "node:http";
import { timingSafeEqual } from "node:crypto";
import Provider from "oidc-provider";

const config = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const users = config.users;
const SCOPE = "openid fleetline";

function same(a, b) {
  const x = Buffer.from(String(a ?? ""));
  const y = Buffer.from(String(b ?? ""));
  return x.length === y.length && timingSafeEqual(x, y);
}

const provider = new Provider(config.issuer, {
  clients: config.clients,
  jwks: config.jwks,
  cookies: { keys: config.cookie_keys },
  // `amr` is a claim like any other to this library: listed, so the id token carries it.
  claims: { openid: ["sub", "amr", "auth_time"], fleetline: ["fleetline_role", "tenant"] },
  scopes: ["openid", "fleetline", "offline_access"],
  // The id token is what fleetline's API and CLI send as the bearer, so it carries the
  // scope's claims itself rather than leaving them to the userinfo endpoint.
  conformIdTokenClaims: false,
  features: { devInteractions: { enabled: false } },
  pkce: { required: () => true },
  ttl: { IdToken: 3600, AccessToken: 3600, AuthorizationCode: 60, Session: 3600, Interaction: 600, Grant: 3600 },
  async findAccount(ctx, id) {
    const user = users[id];
    if (!user) return undefined;
    return {
      accountId: id,
      async claims() {
        return { sub: id, fleetline_role: user.role, ...(user.tenant ? { tenant: user.tenant } : {}) };
      },
    };
  },
  // Every client here is the deployment's own (console, CLI): consent is implied, as an
  // enterprise IdP does for first-party applications.
  async loadExistingGrant(ctx) {
    const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
    if (grantId) return ctx.oidc.provider.Grant.find(grantId);
    const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
    grant.addOIDCScope(SCOPE);
    await grant.save();
    return grant;
  },
  clientBasedCORS(ctx, origin, client) {
    return client.redirectUris.some((uri) => URL.parse(uri)?.origin === origin);
  },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
  renderError(ctx, out) {
    ctx.type = "html";
    ctx.body = `<!doctype html><title>Sign-in error</title><p id="error">${escape(out.error)}: ${escape(out.error_description ?? "")}</p>`;
  },
});

function escape(text) {
  return String(text).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function loginPage(uid, message) {
  return `<!doctype html><html><head><meta charset="utf-8"><title>Sign in</title></head><body>
<h1>Sign in</h1>
<form method="post" action="/interaction/${uid}/login">
<label>User <input name="username" autocomplete="username" autofocus></label>
<label>Password <input name="password" type="password" autocomplete="current-password"></label>
<label>One-time code <input name="otp" inputmode="numeric" autocomplete="one-time-code"></label>
<button type="submit">Sign in</button>
<p id="error" role="alert">${escape(message ?? "")}</p>
</form></body></html>`;
}

async function form(req) {
  let body = "";
  for await (const chunk of req) {
    body += chunk;
    if (body.length > 16384) throw new Error("form too large");
  }
  return Object.fromEntries(new URLSearchParams(body));
}

// A native application (the CLI, through a loopback redirect) is asked for by name: any
// program on the machine can listen on loopback, so the user confirms which one signs in.
function consentPage(uid, client, account) {
  return `<!doctype html><html><head><meta charset="utf-8"><title>Allow</title></head><body>
<h1>Allow ${escape(client)} to sign in as ${escape(account)}?</h1>
<form method="post" action="/interaction/${uid}/consent"><button id="allow" type="submit">Allow</button></form>
</body></html>`;
}

async function consent(req, res, details) {
  const { grantId, prompt, params, session } = details;
  const grant = grantId
    ? await provider.Grant.find(grantId)
    : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
  if (prompt.details.missingOIDCScope) grant.addOIDCScope(prompt.details.missingOIDCScope.join(" "));
  if (prompt.details.missingOIDCClaims) grant.addOIDCClaims(prompt.details.missingOIDCClaims);
  await provider.interactionFinished(req, res, { consent: { grantId: await grant.save() } }, { mergeWithLastSubmission: true });
}

async function interaction(req, res) {
  const details = await provider.interactionDetails(req, res);
  if (req.method === "GET") {
    res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    res.end(
      details.prompt.name === "consent"
        ? consentPage(details.uid, details.params.client_id, details.session.accountId)
        : loginPage(details.uid),
    );
    return;
  }
  if (details.prompt.name === "consent") {
    await consent(req, res, details);
    return;
  }
  const { username, password, otp } = await form(req);
  const user = users[username];
  if (!user || !same(user.password, password)) {
    res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
    res.end(loginPage(details.uid, "Unknown user or wrong password."));
    return;
  }
  let amr = ["pwd"];
  if (otp) {
    if (!user.otp || !same(user.otp, otp)) {
      res.writeHead(200, { "content-type": "text/html; charset=utf-8" });
      res.end(loginPage(details.uid, "Wrong one-time code."));
      return;
    }
    amr = ["pwd", "otp", "mfa"];
  }
  await provider.interactionFinished(req, res, { login: { accountId: username, amr } }, { mergeWithLastSubmission: false });
}

const handle = provider.callback();
const server = http.createServer((req, res) => {
  if (req.url.startsWith("/interaction/")) {
    interaction(req, res).catch((error) => {
      res.writeHead(400, { "content-type": "text/plain" });
      res.end(`sign-in failed: ${error.message}\n`);
    });
    return;
  }
  handle(req, res);
});
server.listen(config.port, config.host ?? "127.0.0.1", () => {
  console.log(`oidc provider ${config.issuer} listening`);
});
for (const signal of ["SIGTERM", "SIGINT"]) process.on(signal, () => server.close(() => process.exit(0)));
