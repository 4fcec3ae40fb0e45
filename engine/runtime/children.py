"""Start, watch and stop the scheduler and detokenizer processes (each runs its folder's
`__main__`: `python -m engine.scheduler` / `python -m engine.detokenizer`)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.runtime.ipc import ChildConfig, Endpoints
from engine.server_args import ServerArgs

# the folder holding the `engine` package (this file is engine/runtime/children.py)
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# the module each kind of child runs (`python -m MODULE ROLE CONFIG`)
CHILD_MODULES = {"scheduler": "engine.scheduler", "detokenizer": "engine.detokenizer"}


@dataclass(frozen=True)
class Role:
    """One child process: its name (the key of get_server_info()'s pids), and for a scheduler
    its data-parallel group and tensor-parallel rank in it."""

    name: str
    kind: str  # a key of CHILD_MODULES
    dp_rank: int = 0
    tp_rank: int = 0

    def describe(self) -> str:
        """How an error names the process: its role, and a scheduler's ranks."""
        if self.kind != "scheduler":
            return f"the {self.name} process"
        return (
            f"the scheduler process of dp rank {self.dp_rank}, tp rank {self.tp_rank} ({self.name})"
        )


def scheduler_name(dp_rank: int, tp_rank: int) -> str:
    """'scheduler' for rank (0, 0); 'scheduler-dp1', 'scheduler-tp1', 'scheduler-dp1-tp1', ..."""
    parts = [f"dp{dp_rank}"] * (dp_rank > 0) + [f"tp{tp_rank}"] * (tp_rank > 0)
    return "-".join(["scheduler", *parts])


def roles(args: ServerArgs) -> list[Role]:
    """A scheduler process per (dp, tp) rank, dp-major, then the detokenizer."""
    ranks = [
        Role(scheduler_name(dp, tp), "scheduler", dp, tp)
        for dp in range(args.dp_size)
        for tp in range(args.tp_size)
    ]
    return [*ranks, Role("detokenizer", "detokenizer")]


class ChildProcesses:
    def __init__(self, args: ServerArgs, endpoints: Endpoints) -> None:
        # NOTE: only this process holds the write end; when it is closed or this process dies,
        # every child sees end-of-file on its read end and exits (engine.runtime.ipc.watch_lifeline).
        read_fd, self._lifeline = os.pipe()
        env = dict(os.environ)
        # the children import `engine` from wherever the caller did, installed or not
        package_root = str(_PACKAGE_ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.roles = {role.name: role for role in roles(args)}
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for role in self.roles.values():
                config_path = Path(endpoints.folder) / f"{role.name}.config"
                config = ChildConfig(
                    role.name, args, endpoints, read_fd, os.getpid(), role.tp_rank, role.dp_rank
                )
                config_path.write_bytes(pickle.dumps(config))
                self.procs[role.name] = subprocess.Popen(
                    [sys.executable, "-m", CHILD_MODULES[role.kind], role.name, str(config_path)],
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

    def exited(self) -> dict[str, int]:
        """{role: exit code} of the children that are no longer running."""
        codes = {role: proc.poll() for role, proc in self.procs.items()}
        return {role: code for role, code in codes.items() if code is not None}

    def group(self, dp_rank: int) -> list[str]:
        """The roles of data-parallel group `dp_rank`'s scheduler processes."""
        return [
            r.name for r in self.roles.values() if r.kind == "scheduler" and r.dp_rank == dp_rank
        ]

    def kill(self, names: list[str]) -> None:
        """End these children now (the rest of a group whose rank died: they would wait on
        their dead peer's collectives until the timeout)."""
        for name in names:
            proc = self.procs[name]
            if proc.poll() is None:
                proc.kill()
            proc.wait()

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
