"""Start, watch and stop the scheduler and detokenizer processes (each runs its folder's
`__main__`: `python -m engine.scheduler` / `python -m engine.detokenizer`)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from engine.runtime.ipc import ChildConfig, Endpoints
from engine.server_args import ServerArgs

# the folder holding the `engine` package (this file is engine/runtime/children.py)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# the module each kind of child runs (`python -m MODULE ROLE CONFIG`)
CHILD_MODULES = {"scheduler": "engine.scheduler", "detokenizer": "engine.detokenizer"}


def roles(tp_size: int) -> list[tuple[str, int]]:
    """(role, tensor-parallel rank): a scheduler process per rank, then the detokenizer."""
    ranks = [("scheduler", 0)] + [(f"scheduler-{r}", r) for r in range(1, tp_size)]
    return [*ranks, ("detokenizer", 0)]


class ChildProcesses:
    def __init__(self, args: ServerArgs, endpoints: Endpoints) -> None:
        # NOTE: only this process holds the write end; when it is closed or this process dies,
        # every child sees end-of-file on its read end and exits (engine.runtime.ipc.watch_lifeline).
        read_fd, self._lifeline = os.pipe()
        env = dict(os.environ)
        # the children import `engine` from wherever the caller did, installed or not
        package_root = str(_PACKAGE_ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for role, rank in roles(args.tp_size):
                config_path = Path(endpoints.folder) / f"{role}.config"
                config_path.write_bytes(
                    pickle.dumps(ChildConfig(role, args, endpoints, read_fd, os.getpid(), rank))
                )
                module = CHILD_MODULES[role.split("-")[0]]
                self.procs[role] = subprocess.Popen(
                    [sys.executable, "-m", module, role, str(config_path)],
                    pass_fds=(read_fd,),
                    stdin=subprocess.DEVNULL,
                    env=env,
                    # NOTE: a session of its own: a terminal's Ctrl-C (SIGINT to its foreground
                    # process group) reaches only the caller, which decides what it means; the
                    # child goes with the caller through the lifeline, however the caller ends
                    start_new_session=True,
                )
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(read_fd)

    @property
    def pids(self) -> dict[str, int]:
        return {role: p.pid for role, p in self.procs.items()}

    def exited(self) -> tuple[str, int] | None:
        """(role, exit code) of a child that is no longer running, if any."""
        for role, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return role, code
        return None

    def stop(self, timeout: float = 5.0) -> None:
        """Cut the lifeline, then make sure every child is gone."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        for proc in self.procs.values():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
