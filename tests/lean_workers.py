"""Work spread over lean worker processes (forkserver: forked from a process that imported
little), so a test uses both cores of the CI machine."""

from __future__ import annotations

import multiprocessing as mp

LEAN = mp.get_context("forkserver")


def _send_result(send, call, args) -> None:
    send.send(call(*args))


def in_lean_workers(call, args_per_worker: list[tuple]) -> list:
    """`call(*args)` in one lean worker per args, at once (workers that fork children of
    their own: not a Pool's daemons); their results, in order."""
    workers = []
    for args in args_per_worker:
        receive, send = LEAN.Pipe(duplex=False)
        p = LEAN.Process(target=_send_result, args=(send, call, args))
        p.start()
        send.close()
        workers.append((p, receive))
    results = []
    for p, receive in workers:
        results.append(receive.recv())  # EOFError: the worker died
        p.join(30)
    return results
