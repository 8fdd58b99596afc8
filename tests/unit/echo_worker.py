"""A worker for test_worker_pool: answers (pid, request * 2); "fail" raises, "die" exits,
"print" prints to stdout first, ("sleep", s) sleeps s seconds."""
import os
import time

from stepgraph.backends.cuda.runtime.worker_pool import serve


def answer(request):
    if request == "fail":
        raise ValueError("asked to fail")
    if request == "die":
        os._exit(3)
    if request == "print":
        print("a library's chatter on stdout")
    if isinstance(request, tuple):
        time.sleep(request[1])
    return os.getpid(), request * 2


if __name__ == "__main__":
    serve(answer)
