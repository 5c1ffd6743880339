"""`TableSource`: a job's arrays in `.npy` files (its own, or those pstrain writes from `train_data()`),
read once into each worker's memory; a closure gathers its rows (as fast as an in-memory array).
`NpyFile` is where one array lies in its file, as read from the header on the chief."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from chief.contract.job import JobError
from worker.input.sources import Nest, Source

# Each of the 256 byte values as a one-byte string: how fixed-width `S` rows become tf.string in-graph.
_BYTES = [bytes([b]) for b in range(256)]


@dataclass(frozen=True)
class NpyFile:
    """Where one array lies in a `.npy` file, as read from its header on the chief.

    Text is a fixed-width NumPy string array: `U` (UTF-32 code points, 4 bytes each) or `S` (bytes),
    each string padded with NULs to the width. The worker memory-maps it like numbers (its code
    points or bytes as int32/uint8, one more axis of the width), gathers rows and only then decodes
    them to tf.string (`strings`): UTF-8 for `U`, the bytes themselves for `S`, trailing NULs dropped
    as NumPy drops them.
    """

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # bytes of header before the data

    @classmethod
    def read_header(cls, path: str, what: str) -> NpyFile:
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                offset = f.tell()
        except FileNotFoundError:
            raise JobError(f"{what}: {path} not found on the chief; every process reads the .npy files at this path") from None
        except ValueError as e:
            raise JobError(f"{what}: {path} is not a .npy file ({e})") from None
        if dtype.hasobject:
            raise JobError(
                f"{what}: {path} holds Python objects, which a worker cannot read; save text as fixed-width strings "
                "(np.save(path, a.astype(str)), or a.astype(bytes))"
            )
        if fortran or not shape or offset % 64:
            raise JobError(
                f"{what}: {path} must hold a C-ordered array with a leading example axis "
                "(save it with np.save(path, np.ascontiguousarray(a)))"
            )
        return cls(str(path), dtype, tuple(shape), offset)

    @property
    def text(self) -> bool:
        return self.dtype.kind in "US"

    @property
    def codes(self) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of the array as the worker holds it: text as code points or bytes, one axis more."""
        if self.dtype.kind == "U":
            return np.dtype(self.dtype.byteorder.replace("|", "=") + "i4"), (*self.shape, self.dtype.itemsize // 4)
        if self.dtype.kind == "S":
            return np.dtype(np.uint8), (*self.shape, self.dtype.itemsize)
        return self.dtype, self.shape

    def load(self) -> tf.Tensor:
        """TF ops: the whole array (text as its codes), memory-mapped from the file where it can be
        (native byte order, not bool): no read of the whole file up front; otherwise decoded from the
        file's bytes."""
        dtype, shape = self.codes
        if dtype == np.bool_ or not dtype.isnative:
            return self._decode()
        itemsize, count = dtype.itemsize, int(np.prod(shape))

        def int64(*values: int) -> tf.Tensor:  # sizes past 2**31 bytes
            return tf.constant(values, tf.int64)

        raw = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[self.offset + count * itemsize], memory_region_name=self.path)
        data = tf.slice(raw, int64(self.offset), int64(count * itemsize))  # the header is 64-byte aligned: a view, no copy
        values = tf.bitcast(tf.reshape(data, int64(count, itemsize)) if itemsize > 1 else data, tf.as_dtype(dtype))
        return tf.reshape(values, int64(*shape))

    def _decode(self) -> tf.Tensor:
        dtype, shape = self.codes
        bool_ = dtype == np.bool_
        raw_dtype = tf.uint8 if bool_ else tf.as_dtype(dtype.newbyteorder("="))
        values = tf.io.decode_raw(tf.io.read_file(self.path), raw_dtype, little_endian=dtype.byteorder != ">")
        values = tf.reshape(values[self.offset // dtype.itemsize :], [-1, *shape[1:]])
        return tf.cast(values, tf.bool) if bool_ else values

    def strings(self, rows: tf.Tensor) -> tf.Tensor:
        """TF ops: gathered rows of `load()` as the array's values (text decoded to tf.string)."""
        if not self.text:
            return rows
        width = self.codes[1][-1]
        flat = tf.reshape(rows, [-1, width])
        if self.dtype.kind == "U":
            text = tf.strings.unicode_encode(tf.RaggedTensor.from_tensor(flat, padding=0), "UTF-8")
        else:
            codes = tf.RaggedTensor.from_tensor(tf.cast(flat, tf.int32), padding=0)
            text = tf.strings.reduce_join(tf.gather(tf.constant(_BYTES), codes), axis=-1)
        return tf.reshape(text, tf.shape(rows)[:-1])


def write_npy(path: Path, array: np.ndarray) -> None:
    """Write an array atomically (tmp + rename), C-ordered."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
    tmp.replace(path)


class TableSource(Source):
    """Arrays read once into each worker's memory from `.npy` files; closures gather their rows."""

    def __init__(self, files: Nest, arrays: Nest):
        self.files = files  # nest of NpyFile, read by the workers
        self.arrays = arrays  # the same nest as arrays in this process (in memory or memory-mapped)
        lengths = {f.shape[0] for f in tf.nest.flatten(files)}
        if len(lengths) != 1:
            raise JobError(f"the arrays hold different numbers of examples ({sorted(lengths)}); they must match")
        self.num_examples = lengths.pop()

    @classmethod
    def from_arrays(cls, data: Nest, directory: Path) -> TableSource:
        """`train_data()` arrays: written once to `directory` (the run dir) for the workers to read."""
        directory.mkdir(parents=True, exist_ok=True)
        leaves = tf.nest.flatten(data)  # text already fixed-width (checked_arrays)
        files = []
        for i, leaf in enumerate(leaves):
            path = directory.resolve() / f"train-{i}.npy"
            write_npy(path, leaf)
            files.append(NpyFile.read_header(str(path), "train_data()"))
        return cls(tf.nest.pack_sequence_as(data, files), data)

    @classmethod
    def from_npy_paths(cls, paths: Nest, what: str) -> TableSource:
        """`train_arrays()`: the job's own .npy files, at the same path on every machine."""
        files = tf.nest.map_structure(lambda p: NpyFile.read_header(str(p), what), paths)
        arrays = tf.nest.map_structure(lambda f: np.load(f.path, mmap_mode="r"), files)
        return cls(files, arrays)

    def read_local(self, indices: np.ndarray) -> Nest:
        return tf.nest.map_structure(lambda a: tf.constant(np.asarray(a[np.asarray(indices)])), self.arrays)

    def _build(self):
        tables = tf.nest.map_structure(NpyFile.load, self.files)
        return tf.cast(tf.shape(tf.nest.flatten(tables)[0])[0], tf.int64), tables

    def _read(self, handle, indices):
        return tf.nest.map_structure(lambda f, t: f.strings(tf.gather(t, indices)), self.files, handle)
