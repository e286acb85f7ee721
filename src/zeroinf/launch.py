"""`python -m zeroinf.launch TORCHRUN_ARGS`: `torch.distributed.run`, minus its failure report when
the ranks stopped on an error that is the user's to fix.

`zeroinf train --nproc N` (and `finetune`) start their ranks through this module. A rank that meets
a user error (cli.py `USER_ERRORS`) writes its one line into the folder `cli.ERROR_DIR_ENV` names
and exits with status 2; torchrun's agent stops the other ranks. torchrun would then log each
failure and print a traceback and a table of the failed ranks; here that is left out, and the
command prints the ranks' distinct lines itself, so the command ends as in one process: one line,
status 2. Any other failure (a bug, a killed rank) keeps torchrun's report.
"""

from __future__ import annotations

import logging
import os
import sys

ERROR_DIR_ENV = "ZEROINF_CLI_ERROR_DIR"  # cli.py takes the name from here


def user_errors_written() -> bool:
    folder = os.environ.get(ERROR_DIR_ENV)
    return folder is not None and os.path.isdir(folder) and bool(os.listdir(folder))


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    quiet = _QuietAfterUserErrors()
    known = logging.Logger.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(v for v in known if isinstance(v, logging.Logger))]
    for handler in {h for logger in loggers for h in logger.handlers}:  # torch's sit on the "torch" logger
        handler.addFilter(quiet)
    try:
        run(args)
    except ChildFailedError:
        if user_errors_written():
            return 2
        raise
    return 0


class _QuietAfterUserErrors(logging.Filter):
    """Drops the agent's log records once a rank wrote a user error (its "failed (exitcode: 2)" line,
    the SIGTERMs it sends the other ranks): the command prints that error instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not user_errors_written()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
