"""The job's code as written: AutoGraph for what the user wrote, none for pstrain's own functions."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx


def as_written(fn: Callable) -> Callable:
    """The job's callable `fn` (its model, a loss's `call`, its optimizer's `apply_gradients`) run as
    inside an autograph=True `tf.function`: converted by AutoGraph (cached per function; Keras's own
    code is left as it is), and a subclassed layer's `call` converted by Keras. pstrain traces its
    own functions with AutoGraph off: they use tf.while_loop and tf.cond directly, and converting
    them took about 2 s of every start-up. Through this, a Python `if` on a tensor in a job's layer,
    loss or optimizer still works as in Keras's `fit`."""

    def converted(*args, **kwargs):
        with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED):
            return tf.__internal__.autograph.tf_convert(fn, ag_ctx.control_status_ctx())(*args, **kwargs)

    return converted
