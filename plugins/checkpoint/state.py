"""State files: a checkpoint's non-tensor state (loops, callbacks, schedulers, RNG states) without pickle.

A state file is an ordinary safetensors file. Its tensors are the state's tensors (and numpy arrays); its header's
``__metadata__`` holds ``{"format": "shardline-state", "version": "1", "value": JSON}``, where ``JSON`` is the
state in a typed JSON grammar that names every value's type, so reading it back builds only plain values and
never imports or calls anything named by the file:

=========================  ==========================================================================
Python value               JSON
=========================  ==========================================================================
None, bool, str, int       itself (a subclass of str, int or float, such as a ``StrEnum`` or numpy's
                           ``float64``, is stored as its plain value)
float                      itself; ``{"float": "nan" | "inf" | "-inf"}`` where it is not finite
list                       ``[...]``
tuple                      ``{"tuple": [...]}``
dict with str keys         ``{"dict": {key: value, ...}}``
dict with other keys       ``{"items": [[key, value], ...]}`` (keys: any of these values but dicts/lists)
set, frozenset             ``{"set": [...]}``, ``{"frozenset": [...]}``
bytes                      ``{"bytes": base64}``
torch.Tensor               ``{"tensor": name}``: the file's tensor ``name`` (dense, read on the CPU)
numpy array                ``{"ndarray": name}``: the same, returned as a numpy array
numpy scalar               ``{"numpy": dtype, "value": ...}`` (bool, integer, float dtypes)
torch.Size, torch.dtype    ``{"size": [...]}``, ``{"dtype": "float32"}``
pathlib path               ``{"path": str}`` (read back as :class:`pathlib.Path`)
=========================  ==========================================================================

Anything else (an object of a user class, an Enum member that is not a str/int subclass, a function, a
sparse tensor, an object-dtype array) is refused by :func:`encode` with a :class:`CheckpointError` naming its
key path (``trainer state['callbacks']['X']['f']``): a checkpoint must be loadable without running code, so it
cannot hold what only code can rebuild. :func:`decode` refuses anything outside the grammar, nesting deeper than
:data:`MAX_DEPTH`, and a header or value that does not fit the file, naming the file.
"""

from __future__ import annotations

import base64
import json
import math
import pathlib
import struct
from typing import Any

import torch

from shardline.plugins.errors import CheckpointError

FORMAT, VERSION = "shardline-state", "1"
#: How deep a state may nest (Lightning's deepest, a loop's progress counters, is 6); deeper is refused both
#: ways, which also catches a value that contains itself.
MAX_DEPTH = 64
#: safetensors refuses headers over 100 MB; the state's JSON lives in the header.
MAX_HEADER = 100_000_000
_NUMPY_KINDS = "biuf"  # numpy scalars and arrays of these kinds: bool, int, uint, float
_SAFETENSORS = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
                torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64",
                torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _refuse(where: str, value: Any, why: str = "") -> CheckpointError:
    kind = type(value)
    return CheckpointError(
        f"{where}: a {kind.__module__}.{kind.__qualname__} cannot be stored in a checkpoint{why} (a checkpoint holds "
        "only plain values: None, bool, int, float, str, bytes, lists, tuples, sets, dicts, paths, tensors and "
        "numpy arrays, so that loading it runs no code; store the object's state as such values)")


class _Encoder:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, value: torch.Tensor, where: str) -> str:
        if value.layout != torch.strided or value.is_quantized or value.is_nested:
            raise _refuse(where, value, f" (a {value.layout} tensor: only dense ones)")
        if value.dtype not in _SAFETENSORS:
            raise _refuse(where, value, f" (dtype {value.dtype}: not one safetensors stores)")
        name = f"t{len(self.tensors)}"
        self.tensors[name] = value.detach().cpu().contiguous()
        return name

    def __call__(self, value: Any, where: str, depth: int = 0) -> Any:  # one branch per type
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels (or contains itself)")
        if value is None or type(value) in (bool, str, int):
            return value
        if isinstance(value, str):  # a subclass (StrEnum): its plain value
            return str.__str__(value)
        if isinstance(value, int):  # a subclass (IntEnum): its plain value
            return int(value)
        if isinstance(value, float):
            value = float(value)
            return value if math.isfinite(value) else {"float": "nan" if math.isnan(value) else
                                                       "inf" if value > 0 else "-inf"}
        deeper = depth + 1
        if isinstance(value, torch.Tensor):
            return {"tensor": self.tensor(value, where)}
        if isinstance(value, torch.Size):
            return {"size": [int(d) for d in value]}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, list):
            return [self(v, f"{where}[{i}]", deeper) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"tuple": [self(v, f"{where}[{i}]", deeper) for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(type(k) is str for k in value):
                return {"dict": {k: self(v, f"{where}[{k!r}]", deeper) for k, v in value.items()}}
            return {"items": [[self._key(k, where, deeper), self(v, f"{where}[{k!r}]", deeper)]
                              for k, v in value.items()]}
        if isinstance(value, set | frozenset):
            kind = "set" if isinstance(value, set) else "frozenset"
            return {kind: [self._key(v, where, deeper) for v in value]}
        if isinstance(value, bytes | bytearray):
            return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, pathlib.PurePath):
            return {"path": str(value)}
        return self._numpy(value, where)

    def _key(self, key: Any, where: str, depth: int) -> Any:
        if isinstance(key, dict | list | set | torch.Tensor):
            raise _refuse(f"{where} key {key!r}", key, " as a dict key or set member")
        return self(key, f"{where} key {key!r}", depth)

    def _numpy(self, value: Any, where: str) -> Any:
        import sys

        numpy = sys.modules.get("numpy")  # a numpy value can only exist where numpy was imported
        if numpy is not None and isinstance(value, numpy.ndarray) and value.dtype.kind in _NUMPY_KINDS:
            return {"ndarray": self.tensor(torch.from_numpy(numpy.ascontiguousarray(value)), where)}
        if numpy is not None and isinstance(value, numpy.generic) and value.dtype.kind in _NUMPY_KINDS:
            return {"numpy": value.dtype.name, "value": value.item()}
        raise _refuse(where, value)


def encode(value: Any, *, where: str = "state") -> bytes:
    """``value`` as the bytes of a state file (module docstring); :class:`CheckpointError` naming the key path
    (``where`` is its root's name) of the first value it cannot hold. The same value gives the same bytes."""
    encoder = _Encoder()
    try:
        text = json.dumps(encoder(value, where), allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise CheckpointError(f"{where}: nested too deep to store") from None
    if len(text) > MAX_HEADER - (1 << 20):
        raise CheckpointError(f"{where}: its non-tensor values take {len(text) / 1e6:.0f} MB of JSON, more than a "
                              f"state file holds ({MAX_HEADER // 10**6} MB); keep large values as tensors")
    return _safetensors(encoder.tensors, {"format": FORMAT, "version": VERSION, "value": text})


def _safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``tensors`` (contiguous, on the CPU) and ``metadata``, its header's keys in a fixed
    order (the library's own writer orders them by hash, so its bytes change from call to call)."""
    header: dict = {"__metadata__": metadata}
    data, offset = [], 0
    for name, tensor in tensors.items():
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _SAFETENSORS[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library's own files do
    return b"".join([struct.pack("<Q", len(text)), text, *data])


class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], path: str):
        self.tensors, self.path = tensors, path

    def bad(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a valid state file ({what})")

    def tensor(self, name: Any) -> torch.Tensor:
        if type(name) is not str or name not in self.tensors:
            raise self.bad(f"it refers to a tensor {name!r} it does not hold")
        return self.tensors[name]

    def __call__(self, node: Any, depth: int = 0) -> Any:  # one branch per tag
        if depth > MAX_DEPTH:
            raise self.bad(f"nested deeper than {MAX_DEPTH} levels")
        if node is None or type(node) in (bool, int, float, str):
            return node
        deeper = depth + 1
        if type(node) is list:
            return [self(v, deeper) for v in node]
        if type(node) is not dict or len(node) not in (1, 2):
            raise self.bad(f"a {type(node).__name__} node {str(node)[:80]!r}")
        (tag, body), = list(node.items())[:1]
        if len(node) == 2:
            if tag != "numpy" or set(node) != {"numpy", "value"}:
                raise self.bad(f"node {str(node)[:80]!r}")
            return self._scalar(node["numpy"], node["value"])
        if tag == "dict" and type(body) is dict:
            return {k: self(v, deeper) for k, v in body.items()}
        if tag == "items" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {self._key(k, deeper): self(v, deeper) for k, v in body}
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            if tag == "tuple":
                return tuple(self(v, deeper) for v in body)
            members = [self._key(v, deeper) for v in body]
            return set(members) if tag == "set" else frozenset(members)
        return self._leaf(tag, body)

    def _leaf(self, tag: str, body: Any) -> Any:  # one branch per tag
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "tensor":
            return self.tensor(body)
        if tag == "ndarray":
            return self.tensor(body).numpy()
        if tag == "size" and type(body) is list and all(type(d) is int for d in body):
            return torch.Size(body)
        if tag == "dtype" and type(body) is str and isinstance(getattr(torch, body, None), torch.dtype):
            return getattr(torch, body)
        if tag == "path" and type(body) is str:
            return pathlib.Path(body)
        if tag == "bytes" and type(body) is str:
            try:
                return base64.b64decode(body, validate=True)
            except ValueError:
                raise self.bad("a 'bytes' value that is not base64") from None
        raise self.bad(f"an unknown node {tag!r}: {str(body)[:80]!r}")

    def _key(self, node: Any, depth: int) -> Any:
        key = self(node, depth)
        try:
            hash(key)
        except TypeError:
            raise self.bad(f"an unhashable dict key or set member {str(node)[:80]!r}") from None
        return key

    def _scalar(self, dtype: Any, value: Any) -> Any:
        import numpy

        try:
            kind = numpy.dtype(dtype) if type(dtype) is str else None
        except TypeError:
            kind = None
        if kind is None or kind.kind not in _NUMPY_KINDS or type(value) not in (bool, int, float):
            raise self.bad(f"a numpy scalar {dtype!r} = {value!r}")
        return kind.type(value)


def header(data: bytes | memoryview, path: str) -> dict:
    """The safetensors header of a state file's bytes, its length checked against the file."""
    if len(data) < 8:
        raise CheckpointError(f"{path}: not a state file ({len(data)} bytes, shorter than a safetensors header)")
    size = struct.unpack("<Q", bytes(data[:8]))[0]
    if size > min(len(data) - 8, MAX_HEADER):
        raise CheckpointError(f"{path}: not a state file (its header claims {size} bytes; the file has "
                              f"{len(data) - 8} after the length)")
    try:
        found = json.loads(bytes(data[8:8 + size]))
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{path}: not a state file (its header is not JSON: {error})") from None
    if type(found) is not dict:
        raise CheckpointError(f"{path}: not a state file (its header is a {type(found).__name__})")
    return found


def decode(data: bytes | memoryview, *, path: str = "state") -> Any:
    """The value of a state file's bytes (module docstring); :class:`CheckpointError` naming ``path`` for
    anything that is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    meta = header(data, path).get("__metadata__")
    if type(meta) is not dict or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        found = (meta.get("format"), meta.get("version")) if type(meta) is dict else None
        raise CheckpointError(f"{path}: not a {FORMAT} file of version {VERSION} (found {found!r})")
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: its tensors cannot be read ({error})") from None
    try:
        node = json.loads(meta.get("value", ""))
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{path}: not a valid state file (its value is not JSON: {error})") from None
    return _Decoder(tensors, path)(node)


__all__ = ["FORMAT", "MAX_DEPTH", "VERSION", "decode", "encode", "header"]
