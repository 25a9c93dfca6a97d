"""Roles, permissions and tenant scope: who may do what to which tenant's resources.

Every API route declares a `Rule` (resource, verb, whether it is tenant-scoped); `authorize`
decides from the principal's role and tenant. Only platform admins (and auditors without a
tenant, for audit records) reach across tenants; everyone else is held to their own tenant,
and asking for another tenant is refused the same way whether or not that tenant exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleetline.errors import PermissionDenied


class Role(StrEnum):
    PLATFORM_ADMIN = "platform-admin"  # reaches across tenants
    TENANT_ADMIN = "tenant-admin"
    USER = "user"
    VIEWER = "viewer"
    AUDITOR = "auditor"  # the audit log (across tenants when it has no tenant)


ROLES = tuple(role.value for role in Role)

FLEET_READ = ("fleet", "read")  # clusters, nodes, GPUs, topology: shared infrastructure
SERVICES_INFER = ("services", "infer")  # a tenant's inference services, through the router
PERMISSIONS: dict[str, frozenset[tuple[str, str]]] = {
    "platform-admin": frozenset(
        {
            FLEET_READ,
            ("fleet", "write"),  # declare clusters
            ("jobs", "read"),
            ("jobs", "write"),
            ("usage", "read"),
            ("datasets", "read"),
            ("audit", "read"),
            ("audit", "export"),
            ("sql", "run"),
            ("quotas", "write"),
            SERVICES_INFER,
        }
    ),
    "tenant-admin": frozenset(
        {
            FLEET_READ,
            ("jobs", "read"),
            ("jobs", "write"),
            ("usage", "read"),
            ("datasets", "read"),
            ("audit", "read"),
            ("audit", "export"),
            SERVICES_INFER,
        }
    ),
    "user": frozenset(
        {
            FLEET_READ,
            ("jobs", "read"),
            ("jobs", "write"),
            ("usage", "read"),
            ("datasets", "read"),
            SERVICES_INFER,
        }
    ),
    "viewer": frozenset({FLEET_READ, ("jobs", "read"), ("usage", "read"), ("datasets", "read")}),
    "auditor": frozenset({FLEET_READ, ("audit", "read"), ("audit", "export")}),
}
# Roles that see sensitive fields (tokens, credentials, personal identifiers) unmasked.
SEES_SENSITIVE = frozenset({"platform-admin"})


@dataclass(frozen=True)
class Principal:
    subject: str
    role: str
    tenant: str | None
    method: str  # "token" or "jwt"
    amr: tuple[str, ...] = ()

    @property
    def sees_sensitive(self) -> bool:
        return self.role in SEES_SENSITIVE


@dataclass(frozen=True)
class Rule:
    resource: str
    verb: str
    tenant_scoped: bool = True


ALL_TENANTS = None  # a scope of None: every tenant


def authorize(principal: Principal, rule: Rule, requested_tenant: str | None = None) -> str | None:
    """The tenant the operation is held to (None: all), or PermissionDenied."""
    allowed = PERMISSIONS.get(principal.role, frozenset())
    if (rule.resource, rule.verb) not in allowed:
        raise PermissionDenied(f"role {principal.role} may not {rule.verb} {rule.resource}")
    if not rule.tenant_scoped:
        return ALL_TENANTS
    crosses = principal.role == "platform-admin" or (
        principal.role == "auditor" and principal.tenant is None and rule.resource == "audit"
    )
    if crosses:
        return requested_tenant
    if principal.tenant is None:
        raise PermissionDenied(f"role {principal.role} needs a tenant for {rule.resource}")
    if requested_tenant is not None and requested_tenant != principal.tenant:
        raise PermissionDenied(f"{principal.subject} may only reach tenant {principal.tenant}")
    return principal.tenant
