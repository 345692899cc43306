"""The torch.distributed.checkpoint (DCP) side of a sharded checkpoint: the model's and optimizer's
state as flat tensors keyed by parameter names (so they load into any wrapping and world size),
read back safely: only tensors go through DCP (which unpickles other values with plain pickle), and
``.metadata`` is read by an unpickler that admits only DCP's metadata classes. DCP costs ~0.7 s to
import: the functions that use it import it when called."""

from __future__ import annotations

import functools
import io
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...base.errors import TurbotrainError
from ...core.distributed import is_loaded_instance
from ...core.main_rank import decided_by_main
from ...core.process_group import in_group
from ...parts.models.moe import EXTRA_STATE_KEY

if TYPE_CHECKING:
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

_SEP = "/"  # between a key's parts: parameter names contain dots
MODEL, OPTIM = "model", "optim"
# model state entries an older checkpoint may lack (a MoE layer's router-bias loads not applied yet)
OPTIONAL_SUFFIXES = ("." + EXTRA_STATE_KEY,)


def _flatten(
    tree: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]
) -> None:
    for key, value in tree.items():
        name = f"{prefix}{_SEP}{key}"
        if isinstance(value, dict):
            _flatten(value, name, tensors, objects)
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            objects[name] = value


def _unflatten(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    start = prefix + _SEP
    for name, value in flat.items():
        if not name.startswith(start):
            continue
        *parents, leaf = name[len(start) :].split(_SEP)
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def split_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and optimizer's state keyed by parameter names: (tensors for DCP, the rest)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict  # costly

    from_optim: dict[str, Any] = {}
    if optimizer is None:
        from_model = get_model_state_dict(model)
    else:
        from_model, from_optim = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    _flatten(from_model, MODEL, tensors, objects)
    _flatten(from_optim.get("state", {}), OPTIM, tensors, objects)
    rest = {"objects": objects, "param_groups": from_optim.get("param_groups", [])}
    return tensors, rest


def _set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    full: bool,
    source: str,
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=full)
    try:
        if optimizer is None:
            set_model_state_dict(model, model_sd, options=options)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
            )
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise TurbotrainError(
            f"{source}: its model state does not fit the model this config builds ({detail}); "
            "resume without overrides that change --model.* settings"
        ) from None


def load_full(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any] | None,
    source: str,
) -> None:
    """Load a one-process model and optimizer state into a possibly wrapped and sharded ``model``; the
    optimizer's state, keyed by position, is re-keyed by name."""
    names = _param_names(model)
    if optimizer is not None and optim_sd is not None:
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        try:
            optim_sd = {
                "state": {order[int(i)]: s for i, s in optim_sd["state"].items()},
                "param_groups": [
                    {**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]
                ],
            }
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TurbotrainError(
                f"{source}: its optimizer state does not fit this optimizer ({exc!r})"
            ) from None
    _set(model, optimizer, model_sd, optim_sd or {}, True, source)


def _param_names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the name a plain (unwrapped, uncompiled) model gives it."""
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}  # compile, AC, FSDP1
    ddp = isinstance(model, DistributedDataParallel)  # its "module." prefix
    out = {}
    for name, p in model.named_parameters():
        parts = [part for part in name.split(".") if part not in wrappers]
        out[id(p)] = ".".join(parts[1:] if ddp and parts[0] == "module" else parts)
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` holds (its classes, sizes, dtypes, paths); refuses the rest."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": None,  # any name: plain dataclasses and enums
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = self._ALLOWED.get(module, set())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path, load_id: str | None = None) -> Metadata:
    """The DCP ``.metadata`` of checkpoint folder ``folder``, read by a restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata  # costly

    path = folder / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise TurbotrainError(f"{path} cannot be read: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(metadata, Metadata):
        raise TurbotrainError(f"{path} is not DCP metadata")
    storage_meta = getattr(metadata, "storage_meta", None)
    if load_id is not None and storage_meta is not None:
        storage_meta.load_id = load_id
    return metadata


def saved_model_tensors(folder: Path) -> dict[str, TensorStorageMetadata]:
    """Name (as a plain model names it) -> DCP's metadata of each model tensor in ``folder``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = MODEL + _SEP
    return {
        name[len(start) :]: meta
        for name, meta in read_metadata(folder).state_dict_metadata.items()
        if name.startswith(start) and isinstance(meta, TensorStorageMetadata)
    }


@functools.cache
def _dcp_load_types() -> tuple[type[FileSystemReader], type]:
    """DCP's file reader with :func:`read_metadata`, and a load planner that refuses a non-tensor
    value; defined on first use (DCP is costly to import)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return read_metadata(Path(self.path), self.load_id)

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise TurbotrainError(
                f"{read_item.dest_index.fqn} is stored as a pickled object; turbotrain checkpoints "
                "hold tensors only"
            )

    return SafeReader, TensorsOnly


def _dcp_load(path: Path, tensors: dict[str, torch.Tensor], source: str) -> None:
    import torch.distributed.checkpoint as dcp  # costly
    from torch.distributed.checkpoint import CheckpointException

    read_metadata(path)  # an unreadable or foreign .metadata says so, not "does not fit"
    reader, tensors_only = _dcp_load_types()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader(path), planner=tensors_only(), no_dist=not in_group())
    except TurbotrainError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        detail = describe(exc)[:300]
        raise TurbotrainError(
            f"{source}: its model or optimizer state does not fit the ones this config builds "
            f"({detail}); resume without overrides that change --model.* settings"
        ) from None


def load_into(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Load checkpoint folder ``path`` (``state``: its ``state.pt``) into ``model`` and ``optimizer`` as
    wrapped here, any world size. A collective: every rank calls it."""
    tensors, _ = split_state(model, optimizer)  # targets shaped as here: DCP fills them (reshards)
    # an unreadable or refused .metadata is said once, by rank 0; then each rank reads its own
    decided_by_main(lambda: read_metadata(path) and None)
    saved = read_metadata(path).state_dict_metadata
    # written by newer versions only: an older checkpoint leaves them as the model has them
    absent = {n for n in tensors if n not in saved and n.rsplit(_SEP, 1)[-1].endswith(OPTIONAL_SUFFIXES)}
    # a MoE layer grown since this checkpoint (fewer experts saved): read as saved, the layer's
    # and the optimizer's load hooks grow them (other shapes were refused when it was chosen)
    sizes = {n: getattr(saved.get(n), "size", None) for n in tensors}
    grown = {n: s for n, t in tensors.items() if (s := sizes[n]) is not None and tuple(s) != tuple(t.shape)}
    tensors = {n: t.new_empty(grown[n]) if n in grown else t for n, t in tensors.items()}
    _dcp_load(path, {n: t for n, t in tensors.items() if n not in absent}, path.name)
    flat = {**tensors, **state.get("objects", {})}
    optim_sd = {"state": _unflatten(flat, OPTIM), "param_groups": state.get("param_groups", [])}
    model_sd = _unflatten(flat, MODEL)
    if grown and optimizer is not None:  # set_state_dict loads the optimizer first: the model first
        # here, so its MoE layers have grown (and know from how many experts) when the optimizer's
        # state grows; then both, as always (the same growth again: its noise is seeded)
        _set(model, None, dict(model_sd), {}, False, path.name)
    _set(model, optimizer, model_sd, optim_sd, False, path.name)


def load_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in checkpoint folder ``path`` as one plain state dict, read alone."""
    start = MODEL + _SEP
    tensors = {
        start + name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved_model_tensors(path).items()
    }
    _dcp_load(path, tensors, path.name)
    return {name[len(start) :]: t for name, t in tensors.items()}


def describe(exc: BaseException) -> str:
    """One line for ``exc`` (for DCP's CheckpointException, the ranks' failures themselves)."""
    if is_dcp_failure(exc):
        return "; ".join(
            f"rank {r}: {type(e).__name__}: {' '.join(str(e).split())}" for r, (e, _) in exc.failures.items()
        )[:400]
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def is_dcp_failure(exc: BaseException) -> TypeGuard[CheckpointException]:
    """``exc`` is DCP's CheckpointException (DCP imported only where it raised one)."""
    return is_loaded_instance(exc, "torch.distributed.checkpoint", "CheckpointException")
