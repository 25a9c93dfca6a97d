"""The launcher between a cluster agent and a workload: `python -m fleetline.agents.cluster.launch
RUN_DIR [--own-group] -- COMMAND...`.

It joins the workload's cgroup (when one was prepared), starts the command as its child, waits
for it and writes its exit code to RUN_DIR/exit (atomically), so the code survives an agent
that was killed meanwhile: a restarted agent reads it and reports the exit instead of starting
the workload again. SIGTERM, sent by the agent to the whole process group, reaches the workload
(which checkpoints and exits); the launcher itself waits on. With `--own-group` the command
(`mpirun`) runs in a process group of its own: its workers join the launcher's group
(`rank.py`, told by FLEETLINE_SIGNAL_GROUP), so the agent's SIGTERM reaches them and not
`mpirun`, which would answer it by killing them before they checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    own_group = len(argv) > 1 and argv[1] == "--own-group"
    if own_group:
        argv = [argv[0], *argv[2:]]
    if len(argv) < 3 or argv[1] != "--":
        print("usage: launch RUN_DIR [--own-group] -- COMMAND...", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cgroup = run_dir / "cgroup"
    if cgroup.exists():
        try:
            Path(cgroup.read_text().strip(), "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            (run_dir / "cgroup-error").write_text(str(exc))
    with open(run_dir / "stdout.log", "ab") as out, open(run_dir / "stderr.log", "ab") as err:
        try:
            child = subprocess.Popen(
                argv[2:],
                stdout=out,
                stderr=err,
                env=(
                    {**os.environ, "FLEETLINE_SIGNAL_GROUP": str(os.getpgid(0))}
                    if own_group
                    else None
                ),
                process_group=0 if own_group else None,
                # The workload gets SIGTERM back (the launcher ignores it).
                preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
            )
        except OSError as exc:
            err.write(f"cannot start {argv[2]!r}: {exc}\n".encode())
            code = 127
        else:
            (run_dir / "child.pid").write_text(str(child.pid))
            code = child.wait()
    if code < 0:
        code = 128 - code  # killed by a signal: the shell's convention
    partial = run_dir / "exit.partial"
    partial.write_text(str(code))
    partial.replace(run_dir / "exit")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
