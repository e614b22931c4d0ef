"""Leaving a process that used torch.distributed.

torch 2.13's interpreter teardown after destroy_process_group sometimes aborts
(SIGABRT, "terminate called without an active exception": seen in about 1 of
5 two-rank runs here), which turns a finished job into a failed one and makes
`torchrun --max-restarts` restart it. So every entry point that ran a process
group leaves through here: flush what was printed, then os._exit with the
status it chose, skipping the teardown. Before that, under torchrun, a rank that
fails writes its line into the error file torchrun gave it (tell_launcher).
"""

import json
import os
import sys
import time


def flush_and_exit(code: int):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tell_launcher(error_file, message, callstack=None):
    """Write why this rank stopped into torchrun's error file for it (TORCHELASTIC_ERROR_FILE;
    None: not under torchrun, nothing written), in the format torch's @record writes
    (torch.distributed.elastic.multiprocessing.errors.ErrorHandler.record_exception).
    torchrun's failure summary then shows `callstack` (our one line, or a crash's
    traceback) as the rank's "traceback", and names the rank that failed first as the
    root cause, instead of "To enable traceback see: ..."."""
    if not error_file:
        return
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": callstack or message, "timestamp": str(int(time.time()))}}}
    try:
        with open(error_file, "w") as f:
            json.dump(data, f)
    except OSError:  # the summary then says what it says without it
        pass
