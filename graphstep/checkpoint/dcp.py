"""Save and load graphstep checkpoints with torch.distributed.checkpoint (DCP), atomically and safely.

``save`` writes into ``<path>.saving`` and swaps it in by renames once every rank is done, so a save killed
at any point leaves a loadable checkpoint (``path``, or ``<path>.old``, which ``load`` falls back to).
``load`` admits DCP's own metadata classes only (graphstep's format pickles nothing), checks everything,
and copies into the static buffers only then: a refused or damaged checkpoint raises ``CheckpointError``
naming the file and changes nothing. ``async_save`` snapshots the state and saves it on a background thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import pickle
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from . import checks, checksums, integrity, sharded
from .integrity import CheckpointError

_SAVING, _OLD = ".saving", ".old"
MODEL_PREFIX = "model."
# What DCP's .metadata pickle may reference: its own dataclasses and the torch types they hold.
_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                 "torch.distributed.checkpoint.planner", "torch.distributed._shard.metadata",
                 "torch.distributed._shard.sharded_tensor.metadata")
_SAFE_GLOBALS = {("torch", "Size"), ("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format"),
                 ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                 ("builtins", "slice"), ("pathlib", "PosixPath"), ("torch.serialization", "_get_layout")}
_TORCH_ENUM_VALUES = {"float32", "float64", "float16", "bfloat16", "uint8", "int64", "int32", "bool", "strided",
                      "contiguous_format", "preserve_format", "channels_last",
                      "float8_e4m3fn", "float8_e5m2"}  # a model's fp8 weights (graphstep.fp8), saved with it


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS or \
                (module == "torch" and name in _TORCH_ENUM_VALUES):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: checkpoint metadata references {module}.{name}, which graphstep "
                              "does not unpickle (only DCP's own metadata classes are allowed)")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by a restricted unpickler (weights_only semantics) and a
    damaged checkpoint reported as ``CheckpointError`` naming the file (``integrity.py``, ``checksums.py``)."""

    _checksums = None  # {file: {byte range: CRC-32}} once set up for a checkpoint saved with checksums

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f.read(), path).load()
        except CheckpointError:
            raise
        except Exception as err:  # any unpickling failure (EOFError, UnpicklingError, ...): a damaged file
            raise integrity.metadata_error(path, err) from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not DCP metadata (it unpickles to a {type(metadata).__name__}); "
                                  "the file is damaged or not a DCP checkpoint's")
        from torch.distributed.checkpoint.metadata import StorageMeta
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        integrity.check_data_files(metadata, os.fspath(self.path))  # missing/empty/truncated: before any read
        self._checksums = checksums.read(os.fspath(self.path), metadata)  # None: saved without checksums
        super().set_up_storage_reader(metadata, *args, **kwargs)

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # which file a decoding error comes from (read_data)
        if self._checksums is not None:  # damaged bytes are refused before they are decoded
            checksums.verify_item(file, os.path.join(os.fspath(self.path), sinfo.relative_path), self._checksums,
                                  sinfo.relative_path, sinfo.offset, sinfo.length)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as err:
            name = getattr(err, "filename", None) or self._reading
            path = os.path.join(os.fspath(self.path), name) if name else os.fspath(self.path)
            raise integrity.data_error(path, err) from err


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner that never unpickles (a pickled entry is refused) and sizes graphstep's JSON
    entries (``optimizer.param_groups``, ``optimizer.meta``: their length is known only from the
    checkpoint) to the saved length. Pass it with ``SafeFileSystemReader`` when loading through DCP
    directly, e.g. with ``OptimizerState`` as a Stateful."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            _size_json_entries(state_dict, metadata.state_dict_metadata, "")
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled object; graphstep "
                              "loads tensors only (weights_only semantics)")


def _size_json_entries(nested: dict, items: dict, prefix: str) -> None:
    for key, value in list(nested.items()):
        fqn = f"{prefix}{key}"
        if isinstance(value, dict):
            _size_json_entries(value, items, fqn + ".")
        elif key in (sharded.META_KEY, sharded.GROUPS_KEY) and fqn in items and \
                isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
            nested[key] = torch.empty(items[fqn].size[0], dtype=torch.uint8)


def _world() -> tuple[int, bool]:
    initialised = dist.is_available() and dist.is_initialized()
    return (dist.get_rank() if initialised else 0), initialised


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when torch.distributed is not initialised (that is the intent)
    and, on every ShardedTensor it plans, that ShardedTensor is deprecated (sharded.py says why we use it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor")
        yield


def _barrier(group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(path: str) -> None:
    """Rank 0: swap ``<path>.saving`` in for ``path`` (each step a rename; load copes with every state)."""
    staged, old = path + _SAVING, path + _OLD
    _fsync_tree(staged)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(staged, path)
    _fsync_dir(parent)
    if os.path.exists(old):
        shutil.rmtree(old)


def _state(opt, model, snapshot: bool) -> dict:
    sd = sharded.sharded_state_dict(opt, snapshot=snapshot)
    sd[checksums.KEY] = torch.ones(1, dtype=torch.uint8)  # a load then requires the checksum files
    if model is not None:
        for key, value in model.state_dict().items():
            sd[MODEL_PREFIX + key] = value.detach().clone() if snapshot else value
    return sd


def _save_state(sd: dict, path: str, group) -> None:
    rank, initialised = _world()
    if rank == 0:
        if os.path.exists(path + _SAVING):
            shutil.rmtree(path + _SAVING)  # a save killed earlier left it: never part of a checkpoint
        os.makedirs(path + _SAVING)
    _barrier(group)
    with _single_process_quiet():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path + _SAVING, sync_files=True), process_group=group)
    ranks = dist.get_world_size(group) if initialised else 1
    checksums.write(path + _SAVING, SafeFileSystemReader(path + _SAVING).read_metadata(),
                    dist.get_rank(group) if initialised else 0, ranks)
    _barrier(group)  # every rank's files are written (and fsynced) before the swap
    if rank == 0:
        _commit(path)
    _barrier(group)


def save(opt, path: str, model: Optional[torch.nn.Module] = None) -> None:
    """Save ``opt`` (and ``model``'s state dict when given) to the directory ``path``, atomically.

    Collective: call it on every rank. Resume with ``load`` at any data-parallel size or bucket layout."""
    _save_state(_state(opt, model, snapshot=False), os.fspath(path), None)


_ASYNC_GROUPS: dict = {}
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphstep-ckpt")


def async_save(opt, path: str, model: Optional[torch.nn.Module] = None) -> concurrent.futures.Future:
    """Snapshot the state now, save it in the background; the future's result is None once committed.

    Collective (every rank calls it, in the same order). The snapshot costs one copy of this rank's
    state; the write runs over a dedicated gloo group so it never interleaves with the step's collectives.
    Wait for a future before starting the next async save to the same path."""
    sd = _state(opt, model, snapshot=True)
    group = None
    _, initialised = _world()
    if initialised:
        key = id(dist.group.WORLD)
        if key not in _ASYNC_GROUPS:
            _ASYNC_GROUPS[key] = dist.new_group(backend="gloo")
        group = _ASYNC_GROUPS[key]
    return _EXECUTOR.submit(_save_state, sd, os.fspath(path), group)


def _resolve(path: str) -> str:
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    if os.path.exists(os.path.join(path + _OLD, ".metadata")):
        warnings.warn(f"{path}: a save was interrupted while swapping directories; loading the previous "
                      f"checkpoint {path + _OLD}")
        return path + _OLD
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory; pass the directory gs.checkpoint.save "
                              "wrote")
    raise CheckpointError(f"{os.path.join(path, '.metadata')}: missing, so {path} holds no checkpoint (not a "
                          "DCP checkpoint, or a save that never committed); load an earlier checkpoint")


def _dcp_load(state: dict, where: str) -> None:
    """``dcp.load`` of ``state`` from ``where``; a failure on any rank as ``CheckpointError`` on every rank
    (DCP's ``CheckpointException`` is a ``BaseException``: it would escape ``except Exception``)."""
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(where), planner=SafeLoadPlanner())
    except CheckpointException as exc:
        error = integrity.from_dcp_failure(exc, where)
        raise error from (error.__cause__ or exc)


def read_metadata(path: str) -> Metadata:
    """The checkpoint's DCP metadata, read safely."""
    return SafeFileSystemReader(_resolve(os.fspath(path))).read_metadata()


def _check_keys(metadata: Metadata, model, path: str) -> dict:
    """Refuse before reading data: pickled objects, unknown version, other params. Returns JSON sizes."""
    items = metadata.state_dict_metadata
    pickled = [k for k, v in items.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(f"{path}: entry '{pickled[0]}' is a pickled object; graphstep loads tensors only "
                              "(weights_only semantics)")
    for key in (sharded.META_KEY, sharded.GROUPS_KEY):
        if key not in items:
            raise CheckpointError(f"{path}: entry '{key}' is missing: not a graphstep sharded checkpoint")
    sizes = {key: items[key].size[0] for key in (sharded.META_KEY, sharded.GROUPS_KEY)}
    if model is not None:
        saved = {k[len(MODEL_PREFIX):]: v for k, v in items.items() if k.startswith(MODEL_PREFIX)}
        live = model.state_dict()
        for key, value in live.items():
            if key not in saved:
                raise CheckpointError(f"{path}: model entry '{key}' is missing (saved from another model?)")
            if tuple(saved[key].size) != tuple(value.shape):
                raise CheckpointError(f"{path}: model entry '{key}' has shape {tuple(saved[key].size)}, "
                                      f"{tuple(value.shape)} here")
            if saved[key].properties.dtype != value.dtype:
                raise CheckpointError(f"{path}: model entry '{key}' was saved as {saved[key].properties.dtype}, "
                                      f"the model's is {value.dtype}: graphstep does not cast (convert the model "
                                      "as it was at the save before loading)")
        extra = sorted(set(saved) - set(live))
        if extra:
            raise CheckpointError(f"{path}: model entry '{extra[0]}' is not in this model (another model?)")
    return sizes


def _dtype(value) -> torch.dtype:
    """The dtype of a plain tensor or of a ``ShardedTensor`` (whatever this rank's shards)."""
    return value.metadata().tensor_properties.dtype if hasattr(value, "local_shards") else value.dtype


@contextlib.contextmanager
def _naming(where: str):
    """A refusal of the checkpoint's contents (``StateDictError``: another model, NaN, a bad entry) as a
    ``CheckpointError`` that names the checkpoint too."""
    try:
        yield
    except checks.StateDictError as err:
        raise CheckpointError(f"{where}: {err}") from err


@torch.no_grad()
def load(opt, path: str, model: Optional[torch.nn.Module] = None) -> None:
    """Load a checkpoint written by ``save`` (any data-parallel size, any bucket layout) into ``opt``
    (and ``model``): validated entirely first, then copied in place; the captured step stays valid.

    Collective: call it on every rank."""
    view = opt.checkpoint_view()
    where = _resolve(os.fspath(path))
    metadata = SafeFileSystemReader(where).read_metadata()
    sizes = _check_keys(metadata, model, where)
    integrity.check_data_files(metadata, where)
    # The metadata entry first (small): the version and the params are checked before the big read.
    head = {sharded.META_KEY: torch.empty(sizes[sharded.META_KEY], dtype=torch.uint8)}
    _dcp_load(head, where)
    with _naming(where):
        sharded.check_meta(view, sharded.decode_json(head[sharded.META_KEY], f"[{sharded.META_KEY!r}]"))
    template = sharded.load_template(view, sizes)
    model_sd = {}
    if model is not None:
        model_sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
        template.update({MODEL_PREFIX + k: v for k, v in model_sd.items()})
    missing = [k for k in template if k not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(f"{where}: entry '{missing[0]}' is missing")
    for key, value in template.items():  # DCP would cast while reading: another dtype is refused first
        saved = metadata.state_dict_metadata[key].properties.dtype
        if saved != _dtype(value):
            raise CheckpointError(f"{where}: entry '{key}' was saved as {saved}, this optimizer keeps "
                                  f"{_dtype(value)} (saved with another main_params_dtype?): graphstep does not "
                                  "cast")
    _dcp_load(template, where)
    opt_sd = {k: v for k, v in template.items() if not k.startswith(MODEL_PREFIX)}
    with _naming(where):
        for key, value in model_sd.items():
            if not checks.all_finite(value):
                raise checks.StateDictError(f"load: model entry '{key}' holds NaN or inf")
        plan = sharded.validate_everywhere(view, opt_sd)  # every check, on every rank, before anything changes
    if model is not None:
        model.load_state_dict(model_sd)  # in place; the params are then published from the main params
    sharded.apply_validated(view, plan)


class OptimizerState:
    """The optimizer as a DCP ``Stateful``, in the reshardable format (``opt.state_dict()`` stays the flat
    one, for ``torch.save`` flows)::

        dcp.save({"optimizer": OptimizerState(opt)}, checkpoint_id=path)
        dcp.load({"optimizer": OptimizerState(opt)}, storage_reader=SafeFileSystemReader(path),
                 planner=SafeLoadPlanner())

    (``gs.checkpoint.save``/``load`` do this with an atomic save and the model included.)"""

    def __init__(self, opt):
        self.opt = opt

    def state_dict(self) -> dict:
        return sharded.sharded_state_dict(self.opt, snapshot=True)

    def load_state_dict(self, state_dict: dict) -> None:
        sharded.load_sharded_state_dict(self.opt, state_dict)
