"""Optimizers for embedding tables whose work follows the rows a step touches, not the table size."""

from __future__ import annotations

import tensorflow as tf
import tf_keras


class LazyAdam(tf_keras.optimizers.legacy.Adam):
    """Adam that, for a row-sparse gradient, updates only the rows in it, as TF Addons' LazyAdam did.

    Stock Adam (legacy and new-style) decays both moments of *every* row on each sparse update and
    moves every row of the variable, so a step's work on the ps grows with the table. Here the
    moments of untouched rows are left as they are (they decay when their row is next touched only by
    what that step contributes), which is the usual choice for large embedding tables. Dense
    gradients get the stock Adam update. `amsgrad` is not supported.
    """

    def __init__(self, *args, **kwargs):
        if kwargs.get("amsgrad"):
            raise ValueError("LazyAdam: amsgrad is not supported; use tf_keras.optimizers.legacy.Adam(amsgrad=True)")
        super().__init__(*args, **kwargs)

    def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
        device, dtype = var.device, var.dtype.base_dtype
        coefficients = (apply_state or {}).get((device, dtype)) or self._fallback_apply_state(device, dtype)
        m, v = self.get_slot(var, "m"), self.get_slot(var, "v")
        m_rows = coefficients["beta_1_t"] * tf.gather(m, indices) + coefficients["one_minus_beta_1_t"] * grad
        v_rows = coefficients["beta_2_t"] * tf.gather(v, indices) + coefficients["one_minus_beta_2_t"] * tf.square(grad)
        step = coefficients["lr"] * m_rows / (tf.sqrt(v_rows) + coefficients["epsilon"])
        return tf.group(
            tf.raw_ops.ResourceScatterUpdate(resource=m.handle, indices=indices, updates=m_rows),
            tf.raw_ops.ResourceScatterUpdate(resource=v.handle, indices=indices, updates=v_rows),
            tf.raw_ops.ResourceScatterSub(resource=var.handle, indices=indices, updates=step),
        )
