"""`python -m stepgraph.bench [--workloads mlp,cnn,big,resnet,convnet,gpt] [--precision fp32]
[--peers ...]`."""

from stepgraph.bench.harness import main

if __name__ == "__main__":
    raise SystemExit(main())
