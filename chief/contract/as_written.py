"""How pstrain runs a job's own code: `as_written`, as inside an autograph=True `tf.function`.

The step's code (worker/replica/replica.py, losses.py, clipping.py) and the dataset sources
(worker/input/datasets.py) call the job's callables through it; it sits beside the job contract,
below both, as the data may not import the step.
"""

from __future__ import annotations

from collections.abc import Callable


def as_written(fn: Callable) -> Callable:
    """The job's callable `fn` (its model, a loss's `call`, its optimizer's `apply_gradients`, its
    `train_dataset`) run as inside an autograph=True `tf.function`: converted by AutoGraph (cached per
    function; Keras's own code is left as it is), with a subclassed layer's `call` and a `map` function
    converted where Keras and tf.data call them. pstrain traces its own functions with AutoGraph off
    (they use tf.while_loop and tf.cond directly, and converting them took about 2 s of every start-up);
    through this, a Python `if` on a tensor in the job's code still works as in Keras's `fit`."""
    import tensorflow as tf
    from tensorflow.python.autograph.core import ag_ctx

    def converted(*args, **kwargs):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
            return tf.__internal__.autograph.tf_convert(fn, ag_ctx.control_status_ctx())(*args, **kwargs)

    return converted
