"""Loop capture: a PyTorch training loop run as the same compiled step compile_train_step builds.

    optimizer.zero_grad()
    out = model(x)                 # a pass opens: recorded the first time, replayed after
    loss = criterion(out, y)       # script-level ops join the pass
    loss.backward()                # the pass closes; it waits for the step
    optimizer.step()               # one compiled step (one CUDA graph replay) runs every pass
    print(loss.item())             # reads the value the step kept (a sync, as in torch)

A *pass* is what happens between the first call of a model with concrete inputs and
`backward()`: module calls and the ops the script applies to their results. The first time a
pass is seen it is traced into a `Program` (passes.RecordPass): eager tensors that enter it
(inputs, labels) become its feeds. Later passes are compared with the program op by op
(passes.ReplayPass) without running the model's Python: the same module, mode, shapes and ops
replay the program; anything else re-records it, with a one-line RecaptureWarning naming the
difference. `optimizer.step()` runs every pass waiting since the last step (several when the
script accumulates gradients) as one compiled step (step.LoopStep): forward of each pass,
backward of the sum of their losses, update. Values the script still holds at that moment
(the output, the loss, a clipped gradient norm) are outputs of the step, read on demand; a value
of the forward read before `optimizer.step()` (the loss after each backward() of a gradient
accumulation) is computed ahead of the step by one more run of the pass's forward (early.py).

What the loop changes between iterations lives on the device (learning rate and the other
`param_groups` values, the step counter); what a capture cannot prove unchanged is a key of
the program (module identity, training flags, feed shapes and dtypes, autocast, trainable
set) or is compared op by op.
"""
# Nothing is imported here: nn.module reaches loop.hooks while the package is still loading;
# the session (loop/session.py) imports the compile pipeline when a script first needs it.
