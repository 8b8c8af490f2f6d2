"""The training loop the recorded-DeepSpeed workloads share (tests/autocast_workload.py,
tests/precision_workload.py): the same calls under either engine."""


def train_steps(engine, batch, steps):
    """Losses of `steps` forward/backward/step calls on batch(0), batch(1), ..."""
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses
