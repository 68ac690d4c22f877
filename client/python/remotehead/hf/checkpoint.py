"""Checkpoints of a Hugging Face model whose lm_head is on the server: model.save_pretrained
(and so Trainer's checkpoints) writes the body with transformers and the head streamed from the
server into a shard of its own (HEAD_SHARD), listed by the checkpoint's index.

A checkpoint directory must load whole or not at all: from_pretrained prefers model.safetensors
to the index, trusts whatever index is there, and only warns about a missing lm_head (which it
then initialises at random). So a save never edits the directory in place:

1. under an exclusive lock on the directory (flock: released by the kernel if the process
   dies), the leftovers of earlier saves that died are removed (staging directories, the
   partial head shard of older versions);
2. transformers saves the model without the head into a hidden staging directory inside the
   target (the same file system, so that the renames below are atomic);
3. the head is exported there, pinned to the server process (incarnation) and the weight
   version the trainer holds: a restarted server raises ServerRestartedError, a head another
   client moved on FAILED_PRECONDITION; then the index is built, listing the head's shard;
4. the staging directory is verified: every tensor the index lists is in the shard it names,
   every shard holds all the bytes its header describes and nothing unlisted, and the head has
   the lm_head's shape and dtype;
5. it is published: first the previous layout's entry points (index, model.safetensors, their
   .bin twins) and its stale shards are removed, so that the directory does not load, then the
   new files are renamed in, the index last.

A failure before 5 leaves the previous checkpoint as it was; a crash during 5 leaves a directory
that does not load; never a new body with an old head. The next save removes what a crash left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import inspect
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Dict, Optional, Tuple

import torch

from remotehead import _safetensors
from remotehead._errors import InvalidArgumentError

# The file a checkpoint's lm_head is written to (model.<variant>-remotehead-lm_head.safetensors
# for a variant).
HEAD_SHARD = "model-remotehead-lm_head.safetensors"
# Staging directories of saves in progress (or of saves that died: removed by the next one).
STAGING_PREFIX = ".remotehead-save-"
# What a file system without locks or directory fsync answers.
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
# The partial head shard that versions before staging wrote next to the checkpoint.
_OLD_PARTIAL_SUFFIX = "-remotehead-lm_head.safetensors.tmp"


def export_weights_to_safetensors(client, head_id: str, path: str, *,
                                  name: str = "lm_head.weight",
                                  dtype: Optional[torch.dtype] = None,
                                  expected_incarnation: str = "",
                                  expected_weight_version: Optional[int] = None) -> int:
    """Writes the head's W [V, D] (in `dtype`, default its own) into a new .safetensors file on
    this machine as `name`, streamed from the server (Client.read_weight_rows: W is never held
    here whole) and atomic (_safetensors.write_file). Returns the bytes written.
    expected_incarnation / expected_weight_version pin the export as read_weight_rows does:
    refused (ServerRestartedError, FAILED_PRECONDITION), nothing is written."""
    info = client.describe_head(head_id)
    if info.has_bias:
        raise InvalidArgumentError(f"head {head_id!r}: expected no bias for a causal LM's "
                                   f"lm_head file; got one")
    dtype = dtype or info.dtype
    return _safetensors.write_file(
        path, name, dtype, (info.vocab_size, info.hidden_size),
        lambda read: client.read_weight_rows(
            head_id, read, dtype=dtype, expected_incarnation=expected_incarnation,
            expected_weight_version=expected_weight_version))


def _add_variant(name: str, variant: Optional[str]) -> str:
    """transformers' naming of a weights variant: model.safetensors -> model.fp16.safetensors."""
    if variant is None:
        return name
    stem, extension = name.rsplit(".", 1)
    return f"{stem}.{variant}.{extension}"


class _Names:
    """The weight files of one variant of a checkpoint, as transformers names them."""

    def __init__(self, variant: Optional[str]):
        self.single = _add_variant("model.safetensors", variant)
        self.index = _add_variant("model.safetensors.index.json", variant)
        stem = self.single[: -len(".safetensors")]
        self.head_shard = f"{stem}-remotehead-lm_head.safetensors"
        self.single_shard = f"{stem}-00001-of-00001.safetensors"  # the single file, indexed
        bin_single = _add_variant("pytorch_model.bin", variant)
        # The files from_pretrained opens a checkpoint by, in its order of preference.
        self.entry_points = (self.single, self.index, bin_single,
                             _add_variant("pytorch_model.bin.index.json", variant))
        self._shards = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors|"
                                  + re.escape(bin_single[: -len(".bin")]) + r"-\d{5}-of-\d{5}\.bin")

    def is_weights(self, filename: str) -> bool:
        """Whether `filename` belongs to this variant's weights (an entry point, a shard, the
        head's shard): what a previous save of the variant may have left."""
        return (filename in self.entry_points or filename == self.head_shard
                or self._shards.fullmatch(filename) is not None)


class CheckpointError(RuntimeError):
    """A checkpoint that failed its verification before publishing: nothing was published."""


def save_head_from_server(model, head) -> None:
    """Makes model.save_pretrained write the head's weights from the server (see the module's
    documentation): `head` is the model's OffloadedHead. Keeps transformers' signature."""
    original = model.save_pretrained
    signature = inspect.signature(original)

    def save_pretrained(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        _save(model, head, original, call)

    save_pretrained.__signature__ = signature
    save_pretrained.__doc__ = original.__doc__
    model.save_pretrained = save_pretrained


def _save(model, head, original, call: inspect.BoundArguments) -> None:
    arguments = call.arguments
    _refuse_unsupported(arguments)
    name = _parameter_name(model, head.lm_head.weight)
    # A tied head (remotehead.hf.tied) is one tensor under two names: written once, under the
    # input embedding's name as transformers writes a tied model; neither is the body's.
    tied_names = tuple(getattr(head, "tied_names", ()))
    name = tied_names[0] if tied_names else name
    state_dict = arguments["state_dict"]
    if state_dict is None:
        state_dict = model.state_dict()
    # The head comes from the server, whatever the local parameter holds (released, or a copy).
    arguments["state_dict"] = {k: v for k, v in state_dict.items()
                               if k != name and k not in tied_names}
    writes = getattr(model, "should_save_on_this_rank", lambda main: main)
    if writes(arguments["is_main_process"]):
        _save_and_publish(head, original, call, name)
    else:
        original(*call.args, **call.kwargs)  # a sharded model's ranks all gather; none writes


def _save_and_publish(head, original, call: inspect.BoundArguments, name: str) -> None:
    """Steps 1 to 5 of the module's documentation, into call's save_directory."""
    arguments = call.arguments
    target = os.fspath(arguments["save_directory"])
    os.makedirs(target, exist_ok=True)
    names = _Names(arguments["variant"])
    weight = head.lm_head.weight
    with _locked(target) as directory_fd:
        _remove_leftovers(target)
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target)
        try:
            arguments["save_directory"] = staging
            original(*call.args, **call.kwargs)
            _add_head(head, staging, names, name, weight.dtype)
            _verify(staging, names, name, tuple(weight.shape), weight.dtype)
            _publish(staging, target, names, directory_fd)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _refuse_unsupported(arguments: dict) -> None:
    """Saves whose files transformers writes elsewhere than the directory, or in another
    format: the head would not be in them."""
    if arguments.get("push_to_hub"):
        raise ValueError("push_to_hub: expected False (transformers would upload the files "
                         "before the head is added); got True — save, then upload the "
                         "directory")
    if arguments.get("distributed_checkpoint"):
        raise ValueError("distributed_checkpoint: expected False (the head on the server is "
                         "not part of a DCP checkpoint); got True")


def _parameter_name(model, parameter) -> str:
    """The head's name in the model's state dict: its parameter's, or, for a released head
    (remotehead.hf.surgery: the lm_head's attribute `weight`, no parameter), the lm_head's."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is parameter:
            return name
    for name, module in model.named_modules(remove_duplicate=False):
        if module.__dict__.get("weight") is parameter:
            return f"{name}.weight" if name else "weight"
    raise ValueError("lm_head.weight: expected a parameter of the model; not found")


@contextlib.contextmanager
def _locked(directory: str):
    """An exclusive flock on `directory` for one save at a time (so that a staging directory
    found under it belongs to a save that died); yields the directory's descriptor."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            # Some network and FUSE file systems have no locks: saving still works there, but
            # two saves into one directory at once are not kept apart.
            if e.errno not in _UNSUPPORTED:
                raise
            warnings.warn(f"remotehead: {directory}: no file lock on this file system "
                          f"({e.strerror}); do not save into it from two processes at once")
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _remove_leftovers(target: str) -> None:
    for entry in os.listdir(target):
        path = os.path.join(target, entry)
        if entry.startswith(STAGING_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path)
        elif entry.endswith(_OLD_PARTIAL_SUFFIX) and os.path.isfile(path):
            os.remove(path)


def _add_head(head, staging: str, names: _Names, name: str, dtype: torch.dtype) -> None:
    """Exports the server's head into the staging directory, pinned to what the trainer
    holds, and writes the index that lists it next to the body transformers saved there."""
    export_weights_to_safetensors(
        head.client, head.head_id, os.path.join(staging, names.head_shard), name=name,
        dtype=dtype, expected_incarnation=head.incarnation,
        expected_weight_version=head.info.weight_version)
    index = _body_index(staging, names)
    if name in index["weight_map"]:
        raise CheckpointError(f"{name}: expected only in {names.head_shard}; transformers saved "
                              f"it in {index['weight_map'][name]} too")
    header = _safetensors.read_header(os.path.join(staging, names.head_shard))
    metadata = index.setdefault("metadata", {})
    metadata["total_size"] = metadata.get("total_size", 0) + _safetensors.tensor_bytes(header)
    index["weight_map"][name] = names.head_shard
    with open(os.path.join(staging, names.index), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _body_index(staging: str, names: _Names) -> dict:
    """The index of the body transformers saved: its own for a sharded body; for a single
    file (which from_pretrained would open instead of any index), the file renamed into a shard
    and an index made for it."""
    index_path = os.path.join(staging, names.index)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            return json.load(f)
    single = os.path.join(staging, names.single)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"save_pretrained: expected {names.single} or {names.index} (a "
                                f"safetensors checkpoint) to add the remote head to; "
                                f"transformers wrote neither")
    os.replace(single, os.path.join(staging, names.single_shard))
    header = _safetensors.read_header(os.path.join(staging, names.single_shard))
    return {"metadata": {"total_size": _safetensors.tensor_bytes(header)},
            "weight_map": {k: names.single_shard for k in header if k != "__metadata__"}}


def _verify(staging: str, names: _Names, name: str, shape: Tuple[int, ...],
            dtype: torch.dtype) -> None:
    """CheckpointError unless the staged checkpoint loads whole: see the module's step 4."""
    if os.path.exists(os.path.join(staging, names.single)):
        raise CheckpointError(f"{names.single}: expected none next to {names.index} "
                              f"(from_pretrained would open it instead); got one")
    with open(os.path.join(staging, names.index), encoding="utf-8") as f:
        weight_map: Dict[str, str] = json.load(f)["weight_map"]
    headers = {}
    for tensor, shard in sorted(weight_map.items()):
        if shard not in headers:
            headers[shard] = _complete_header(os.path.join(staging, shard))
        if tensor not in headers[shard]:
            raise CheckpointError(f"{names.index}: lists {tensor} in {shard}; {shard} does not "
                                  f"hold it")
    for shard, header in headers.items():
        unlisted = sorted(k for k in header if k != "__metadata__" and weight_map.get(k) != shard)
        if unlisted:
            raise CheckpointError(f"{shard}: holds {unlisted[0]}, which {names.index} does not "
                                  f"list there")
    if weight_map.get(name) != names.head_shard:
        raise CheckpointError(f"{names.index}: expected {name} in {names.head_shard}; got "
                              f"{weight_map.get(name)}")
    entry = headers[names.head_shard][name]
    expected = {"dtype": _safetensors.dtype_name(dtype), "shape": list(shape)}
    got = {"dtype": entry["dtype"], "shape": entry["shape"]}
    if got != expected:
        raise CheckpointError(f"{names.head_shard}: expected {name} as {expected} (the model's "
                              f"lm_head); the server's head is {got}")


def _complete_header(path: str) -> dict:
    try:
        return _safetensors.read_complete_header(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.basename(path)}: {e}") from None


def _publish(staging: str, target: str, names: _Names, directory_fd: int) -> None:
    """Moves the verified checkpoint from `staging` into `target`: the old layout out first
    (the directory then does not load), the new files in, the index last."""
    new = sorted(os.listdir(staging))
    for entry in new:  # on disk before any rename makes them part of the checkpoint
        _fsync(os.path.join(staging, entry))
    for entry in names.entry_points:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(target, entry))
    for entry in os.listdir(target):
        if names.is_weights(entry) and entry not in new:
            os.remove(os.path.join(target, entry))
    _sync_directory(directory_fd)  # the removals reach the disk before the new index can
    for entry in new:
        if entry != names.index:
            os.replace(os.path.join(staging, entry), os.path.join(target, entry))
    os.replace(os.path.join(staging, names.index), os.path.join(target, names.index))
    _sync_directory(directory_fd)


def _sync_directory(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:  # a file system that cannot: its renames are its own
            raise


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
