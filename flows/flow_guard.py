"""`guarded_flow`: Prefect's `@flow` for the flows a script may call, refusing a call made while a spawned process
re-imports that script.

Python's "spawn" and "forkserver" start methods run the parent's main module again in each child process (as
`__mp_main__`). A script that calls a flow at module level, without `if __name__ == "__main__":`, would start a
second run in every process the run spawns (the model build, a process pool): its own Prefect temporary server,
Ray and MLflow run, left running when the child is stopped. The call fails instead, in one line that says what to
do, before Prefect starts anything. The CLI, deployments and pytest are not affected: their main modules are guarded.

A flow called here also starts Prefect's temporary server first where it will need one, shielded from a terminal's
Ctrl-C (`tasks.prefect_api`): the run, not the server, decides what a Ctrl-C does.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Flow

from rlstages.tasks.prefect_api import start_temporary_server

P = ParamSpec("P")
R = TypeVar("R")


def importing_main_in_child() -> bool:
    """Whether this process is a spawned child still importing its parent's main module (multiprocessing marks that
    phase with `_inheriting`, the flag behind its own "bootstrapping phase" error)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


class GuardedFlow(Flow[P, R]):
    """A Prefect flow that refuses to start from a spawned child's import of the caller's script."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]  # Flow's overloads, passed on
        """Run the flow as Prefect's `Flow.__call__` does (its temporary server, where it needs one, shielded from
        Ctrl-C), unless a spawned child is importing the caller's script."""
        if importing_main_in_child():
            raise RuntimeError(
                f"flow {self.name!r} was called while a process started by the run imported your script again "
                "(Python's spawn start method runs the main module in each child): put the call under "
                '`if __name__ == "__main__":`'
            )
        start_temporary_server()
        return super().__call__(*args, **kwargs)


def guarded_flow(**options: Any) -> Callable[[Callable[P, R]], GuardedFlow[P, R]]:
    """`@flow(**options)` as a `GuardedFlow`."""

    def wrap(fn: Callable[P, R]) -> GuardedFlow[P, R]:
        return GuardedFlow(fn=fn, **options)

    return wrap
