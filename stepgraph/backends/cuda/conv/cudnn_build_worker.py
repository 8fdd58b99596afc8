"""A build worker of cudnn_compiled's pool (`python -m` this module): it answers each request
(a problem, and which plan) with that runtime-compiled plan built and serialized
(cudnn_compiled.build_requested)."""
from stepgraph.backends.cuda.conv.cudnn_compiled import build_requested
from stepgraph.backends.cuda.runtime.worker_pool import serve

if __name__ == "__main__":
    serve(build_requested)
