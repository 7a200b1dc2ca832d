"""A conformance worker: `python -m graphmode.conformance.worker SUITE OPTIONS_JSON`.

Reads pickled `Case` frames on stdin, answers each with a pickled `Judged` on the original
stdout, until stdin closes. Whatever the case prints goes to stderr (the parent's log), so it
cannot corrupt the frames.
"""
from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    suite_name, options = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    out = os.dup(1)           # the frames' channel
    os.dup2(2, 1)             # prints (ours, torch's, compilers') go to the log
    sys.stdout = sys.stderr
    from graphmode.conformance.runner import _Died, get_suite, judge, recv_frame, send_frame
    suite = get_suite(suite_name, **options)
    send_frame(out, "ready")
    while True:
        try:
            case = recv_frame(0)
        except _Died:
            return 0
        judged = judge_case(suite, case, judge)
        send_frame(out, judged)


def judge_case(suite, case, judge):
    """suite.run_case, with an exception escaping the suite itself classified as a crash."""
    try:
        return suite.run_case(case)
    except Exception as e:  # noqa: BLE001 - a suite bug is reported as this case's crash
        def rethrow():
            raise e
        return judge(rethrow)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
