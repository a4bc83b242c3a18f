"""torchrun as `partitioner run` starts it: `python -m runtime._torchrun TORCHRUN-ARGS`.

torch.distributed.run's own entry point ends a failed job with the launcher's traceback
and a table of the failed ranks (ChildFailedError), some 40 lines after the rank's one
clear message.  This one runs the same launch (`torch.distributed.run.run`), and when a
rank fails it prints instead each rank's error once, after every rank has ended, and
where no rank's own error says what happened, the failure: the rank killed, or the rank
that hung ([Note: heartbeats] in restarts.py), by `restarts.tell`; exit status 1.
Meanwhile it watches the status folder (PARTITIONER_STATUS_DIR) as `restarts.watch` says.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from . import restarts

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run torchrun with `argv`; 0 when every rank succeeded, else 1 once the failure is told."""
    args = torchrun.parse_args(argv)
    folder = Path(os.environ[restarts.STATUS_ENV]) if os.environ.get(restarts.STATUS_ENV) else None
    done = threading.Event()
    watcher = threading.Thread(target=restarts.watch, args=(folder, done), daemon=True) if folder else None
    if watcher is not None:
        watcher.start()
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as exc:
        exits = {rank: failed.exitcode for rank, failed in exc.failures.items()}
        rank, first = exc.get_first_failure()
    finally:
        done.set()
        if watcher is not None:
            watcher.join()
    restarts.tell(folder, exits, (rank, first.exitcode))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
