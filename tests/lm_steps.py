"""The training loop the tensor-parallel tests share: a Hugging Face causal LM under an engine
whose mesh has a "data" axis, each data rank training on its own rows of one global batch."""


def train_lm_steps(engine, tokens, steps, rows):
    """Train engine on each step number in `steps`: data rank d takes rows [d*rows, (d+1)*rows) of
    tokens(step), labels equal to inputs. Returns the per-step losses averaged over the data
    ranks, so every data-parallel size reports the loss of the whole batch."""
    from dslaunch.runtime import comm

    d, dp = engine.mesh.rank("data"), engine.mesh.size("data")
    losses = []
    for step in steps:
        batch = tokens(step)[d * rows:(d + 1) * rows]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1).clone()
        if dp > 1:
            comm.all_reduce(t, group=engine.mesh.group("data"), label="test loss")
            t /= dp
        losses.append(float(t))
    return losses
