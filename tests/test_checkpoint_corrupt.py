"""A damaged or foreign checkpoint on disk: ``gs.checkpoint.load`` raises
``graphstep.checkpoint.CheckpointError`` (an ``Exception``, so a resume path's ``except Exception`` sees it)
naming the file and what is wrong, chained to the original error where there is one, and the optimizer
(params, main params, state, step count, loss scale, groups) stays bitwise unchanged.

Before: a garbage or truncated ``.metadata`` raised the unpickler's raw error naming no file, and a
missing, empty, truncated or garbage data file raised DCP's ``CheckpointException`` (a ``BaseException``).
One checkpoint is saved per module; each test damages a copy of it."""

import os
import pickle
import random
import shutil

import pytest
import torch
from test_checkpoint import ADAM, assert_same, engine, everything, train
from toy import tiny_transformer

import graphstep as gs
from graphstep.checkpoint import CheckpointError, checksums
from graphstep.checkpoint.state_dict import StateDictError

# A dynamic loss scale too (a refused load must leave it unchanged), starting low enough that steps apply.
# kernel="fused" spelled out: the module-scoped fixture runs before conftest's per-test pin of "auto".
FP16_ADAM = dict(ADAM, fp16=True, initial_loss_scale=1024.0, kernel="fused")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the fp16 toy after 3 steps (optimizer and model)."""
    model = tiny_transformer().half()
    opt = engine(model, **FP16_ADAM)
    train(model, opt, 3)
    path = tmp_path_factory.mktemp("good") / "ckpt"
    gs.checkpoint.save(opt, path, model=model)
    return path


@pytest.fixture
def target():
    """The optimizer a refused load must leave alone: another seed, 2 steps (its state differs)."""
    model = tiny_transformer(seed=1).half()
    opt = engine(model, **FP16_ADAM)
    train(model, opt, 2)
    assert opt.scaler is not None  # so everything() holds a loss scale
    return model, opt


def copy_of(saved, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    return path


def data_file(path):
    (name,) = [f for f in os.listdir(path) if f.endswith(".distcp")]  # one process: one data file
    return path / name


def refused(opt, load, names, cause=None) -> CheckpointError:
    """``load()`` raises CheckpointError whose message contains ``names``, chained to a ``cause`` (a type)
    if given; everything the optimizer holds is bitwise what it was."""
    before = everything(opt)
    try:
        load()
    except Exception as err:  # what a resume path catches: DCP's CheckpointException would escape it
        error = err
    else:
        pytest.fail("the damaged checkpoint loaded")
    assert isinstance(error, CheckpointError), f"{type(error).__name__}: {error}"
    assert str(names) in str(error), str(error)
    if cause is not None:
        assert isinstance(error.__cause__, cause), repr(error.__cause__)
    assert_same(everything(opt), before)  # params, main params, state, step, scaler state, groups
    return error


def truncate(file, size):
    with open(file, "r+b") as f:
        f.truncate(size)


def overwrite_with_garbage(file):
    size = os.path.getsize(file)
    with open(file, "wb") as f:
        f.write(random.Random(0).randbytes(size))


# ---- the directory and its .metadata -----------------------------------------------------------------
def test_a_missing_directory_is_refused_naming_it(tmp_path, target):
    model, opt = target
    path = tmp_path / "never_saved"
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path)
    assert "no such checkpoint directory" in str(error)


def test_a_missing_metadata_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    os.remove(path / ".metadata")
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata")
    assert "missing" in str(error)


def test_an_empty_metadata_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    truncate(path / ".metadata", 0)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata", EOFError)
    assert "empty (0 bytes)" in str(error)


def test_a_garbage_metadata_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    overwrite_with_garbage(path / ".metadata")
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata",
                    pickle.UnpicklingError)
    assert "damaged" in str(error)


def test_a_metadata_file_one_byte_short_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    truncate(path / ".metadata", os.path.getsize(path / ".metadata") - 1)  # the pickle's STOP byte gone
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata",
                    (pickle.UnpicklingError, EOFError))
    assert "damaged" in str(error)


# ---- the data file -----------------------------------------------------------------------------------
def test_a_missing_data_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    file = data_file(path)
    os.remove(file)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file)
    assert "missing" in str(error)


def test_an_empty_data_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    file = data_file(path)
    truncate(file, 0)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file)
    assert "empty (0 bytes" in str(error)


def test_a_data_file_one_byte_short_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    file = data_file(path)
    size = os.path.getsize(file)
    truncate(file, size - 1)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file)
    assert f"truncated ({size - 1} bytes" in str(error) and str(size) in str(error)


def test_a_garbage_data_file_is_refused_naming_it_by_its_checksum(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    file = data_file(path)
    overwrite_with_garbage(file)  # same size: the size check passes, the first item's checksum fails
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file)
    assert "damaged" in str(error) and "checksum the save recorded" in str(error)


def test_a_garbage_data_file_without_checksums_is_refused_by_decoding(saved, tmp_path, target):
    # A checkpoint saved by DCP directly has no checksums: the bytes' decoding is the last line of defence.
    model, opt = target
    path = copy_of(saved, tmp_path)
    unchecked(path)
    file = data_file(path)
    overwrite_with_garbage(file)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file, Exception)
    assert "damaged" in str(error) and not isinstance(error.__cause__, CheckpointError)
    assert "weights_only" not in str(error)  # torch.load's advice is the wrong cure for a damaged file


def test_one_flipped_bit_inside_a_saved_tensor_is_refused_naming_the_file(saved, tmp_path, target):
    # The bytes still decode (a tensor's raw bytes decode whatever they hold): only the checksum sees it.
    model, opt = target
    path = copy_of(saved, tmp_path)
    file = data_file(path)
    item = max((info for info in gs.checkpoint.read_metadata(path).storage_data.values()), key=lambda i: i.length)
    with open(file, "r+b") as f:
        f.seek(item.offset + item.length // 2)  # the middle of the largest item: its tensor's bytes
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), file)
    assert f"bytes {item.offset}+{item.length} do not match the checksum" in str(error)


def test_a_missing_or_damaged_checksum_file_is_refused_naming_it(saved, tmp_path, target):
    model, opt = target
    path = copy_of(saved, tmp_path)
    (checksum_file,) = path.glob("__checksums_*.json")
    checksum_file.write_text("{not json")
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), checksum_file)
    assert "checksum file is damaged" in str(error)
    checksum_file.unlink()
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path)
    assert "saved with checksum files" in str(error)


def test_a_changed_metadata_file_is_refused_by_its_checksum(saved, tmp_path, target):
    # Metadata that still unpickles, with one range moved: the data would be read from the wrong bytes.
    model, opt = target
    path = copy_of(saved, tmp_path)
    metadata = gs.checkpoint.read_metadata(path)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f, protocol=2)  # the same content, other bytes
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata")
    assert "do not match the checksum" in str(error)


def unchecked(path):
    """Make ``path`` a checkpoint as DCP writes it directly: no checksum files, no entry asking for them."""
    for f in path.glob("__checksums_*.json"):
        f.unlink()
    metadata = gs.checkpoint.read_metadata(path)
    del metadata.state_dict_metadata[checksums.KEY]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_a_data_file_listed_outside_the_directory_is_refused(saved, tmp_path, target):
    """Metadata naming ``../x`` (a damaged or hostile file) is refused before anything is opened."""
    model, opt = target
    path = copy_of(saved, tmp_path)
    metadata = gs.checkpoint.read_metadata(path)
    for info in metadata.storage_data.values():
        info.relative_path = os.path.join(os.pardir, "elsewhere.distcp")
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    error = refused(opt, lambda: gs.checkpoint.load(opt, path, model=model), path / ".metadata")
    assert "inside the" in str(error) and "elsewhere.distcp" in str(error)


# ---- another model -----------------------------------------------------------------------------------
def wider_target():
    model = torch.nn.Sequential(*list(tiny_transformer(seed=1).children())[:3], torch.nn.Linear(32, 65)).half()
    opt = engine(model, **FP16_ADAM)
    opt.scale_loss(model(torch.randint(0, 64, (2, 8))).float().square().mean()).backward()
    opt.step()  # state that differs from a fresh optimizer's
    return model, opt


def test_a_checkpoint_of_another_model_is_refused_naming_it_and_the_param(saved):
    model, opt = wider_target()
    error = refused(opt, lambda: gs.checkpoint.load(opt, saved), saved, StateDictError)
    assert "'3.weight'" in str(error) and "shape" in str(error)  # the optimizer's own check, now with the path
    error = refused(opt, lambda: gs.checkpoint.load(opt, saved, model=model), saved)
    assert "'3.weight'" in str(error) and "shape" in str(error)  # the model's entries, checked first


@pytest.mark.parametrize("saved_dtype, live_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_main_params_of_another_dtype_are_refused_not_cast(tmp_path, saved_dtype, live_dtype):
    # DCP casts into the load template's dtype while reading: the dtypes are compared before it reads.
    model = tiny_transformer()
    opt = engine(model, **ADAM, kernel="fused", main_params_dtype=saved_dtype)
    train(model, opt, 2)
    gs.checkpoint.save(opt, tmp_path / "ckpt")
    live_model = tiny_transformer(seed=1)
    live = engine(live_model, **ADAM, kernel="fused", main_params_dtype=live_dtype)
    train(live_model, live, 1)
    error = refused(live, lambda: gs.checkpoint.load(live, tmp_path / "ckpt"), "optimizer.state.fp32_param.")
    assert f"was saved as {saved_dtype}, this optimizer keeps {live_dtype}" in str(error)


def test_a_model_entry_of_another_dtype_is_refused_not_cast(saved, target):
    model, opt = target
    error = refused(opt, lambda: gs.checkpoint.load(opt, saved, model=model.float()), saved)
    assert "was saved as torch.float16, the model's is torch.float32" in str(error)


def test_the_undamaged_copy_loads(saved, tmp_path, target):
    """The control: the same copy, undamaged, loads into the same target (so the refusals above are the
    damage's, not the copy's or the target's)."""
    model, opt = target
    path = copy_of(saved, tmp_path)
    assert int(opt.tensors.step) == 2
    gs.checkpoint.load(opt, path, model=model)
    assert int(opt.tensors.step) == 3
