"""Every private torch name graphstep and capture use, and a check that this torch still has each.

torch does not promise its private names from one release to the next, and the GPU machine brings its own
torch. The preflight checks this list before any other part runs and names each that is missing, so a
renamed attribute reads as one line, not as a crash deep inside a step. tests/test_gpu_check_torch_api.py
scans graphstep/ and capture/ and fails when a private name is used there that this list does not hold.

Three kinds of entries:

- ``NAMES``: dotted paths, resolved by importing the longest importable prefix and ``getattr`` on the rest
  (ops as ``torch.ops.<namespace>.<op>``);
- ``MEMBERS``: attributes of torch objects that are set on instances (``FSDPParam._sharded_param_data``),
  so the class has no such attribute to look up: present when the class has it or its module's source
  assigns or defines it;
- ``INDUCTOR_OPTIONS`` / ``DYNAMO_OPTIONS``: config option names graphstep sets;
- ``OPTIONAL``: names graphstep does without where torch lacks them (reported, not failed), with what is lost.

A member written ``a|b`` is present when either is (a name torch renamed, where graphstep reads both).
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Optional

NAMES = (
    # fused and foreach kernels the update, clipping, buffers and the bench call
    "torch._fused_adam_", "torch._fused_adamw_", "torch._fused_sgd_",
    "torch._foreach_copy_", "torch._foreach_zero_", "torch._foreach_norm", "torch._foreach_max",
    # capture: the recorder, the custom-op wrapper, the CUDA backend, the c10d work detector
    "torch._C._DisableAutocast", "torch._C._ForceDispatchKeyGuard",
    "torch._C._dispatch_tls_local_include_set", "torch._C._dispatch_tls_local_exclude_set",
    "torch._C._distributed_c10d.ProcessGroup.unbox", "torch._C._distributed_c10d.Work",
    "torch._C._accelerator_setAllocatorSettings",
    "torch.ScriptObject._type", "torch.UntypedStorage._new_with_weak_ptr", "torch.UntypedStorage._cdata",
    "torch._C.StorageBase.resize_", "torch._C.DisableTorchFunctionSubclass",
    "torch.cuda.memory._snapshot",
    "torch.overrides._get_current_function_mode_stack", "torch.overrides._pop_mode_temporarily",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch.utils._pytree.tree_flatten", "torch.utils._pytree.tree_leaves", "torch.utils._pytree.tree_unflatten",
    "torch.optim.Optimizer._accelerator_graph_capture_health_check",
    "torch.distributed.distributed_c10d._resolve_process_group",
    "torch.distributed.ProcessGroup._get_sequence_number_for_group",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch.Tensor._version",
    # aten ops the capture rules classify by identity
    "torch.ops.aten._local_scalar_dense", "torch.ops.aten._index_put_impl_", "torch.ops.aten._copy_from",
    "torch.ops.aten._copy_from_and_resize", "torch.ops.aten._to_copy",
    # the step's functional collectives (graphstep/parallel/collectives.py)
    "torch.ops._c10d_functional.wait_tensor", "torch.ops._c10d_functional.all_reduce_",
    "torch.ops._c10d_functional.all_gather_into_tensor_out", "torch.ops._c10d_functional.reduce_scatter_tensor_out",
    # torch.compile: the compiled kernels, the dynamo compile callback, the inductor cache directory
    "torch._dynamo.mark_dynamic", "torch._dynamo.config.patch", "torch._dynamo.callback.callback_handler",
    "torch._inductor.config.get_config_copy", "torch._inductor.cpu_vec_isa.pick_vec_isa",
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    # graphstep/native: the compiled per-param checks are built against the running torch's C++ ABI
    "torch._C._GLIBCXX_USE_CXX11_ABI",
    # sharded checkpoints and FSDP2's placements
    "torch.distributed._shard.metadata.ShardMetadata", "torch.distributed._shard.sharded_tensor.Shard",
    "torch.distributed._shard.sharded_tensor.ShardedTensor",
    "torch.distributed._shard.sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata",
    "torch.distributed._shard.sharded_tensor.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
    "torch.distributed.device_mesh.DeviceMesh._get_root_mesh", "torch.distributed.device_mesh.DeviceMesh._flatten",
)

_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam"
MEMBERS = {
    # graphstep/fsdp2: the param FSDP2 all-gathers from is rebound to graphstep's flat buffer
    _FSDP_PARAM: ("_sharded_param_data", "padded_sharded_param_size", "_orig_size", "sharded_size",
                  "sharded_param", "fsdp_placement", "offload_to_cpu", "to_sharded_dtensor"),
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": ("_fsdp_param_groups|_fsdp_param_group",),
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup": ("fsdp_params",),
    "torch.distributed.tensor.DTensor": ("_local_tensor",),
    "torch.nn.Module": ("_parameters",),
    "torch.optim.Optimizer": ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"),
}

OPTIONAL = {
    "torch._C._accelerator_getAllocatorSettings":
        "capture/backends/cuda.py cannot see allocator settings made at run time (only PYTORCH_CUDA_ALLOC_CONF) "
        "when it checks for expandable segments before capturing NCCL collectives",
}

INDUCTOR_OPTIONS = ("size_asserts", "cpp.dynamic_threads", "cpp.simdlen")  # graphstep/kernels/compiled.py
DYNAMO_OPTIONS = ("recompile_limit",)  # torch._dynamo.config.patch(...) around the compiled kernels

# Private names the source uses that are not torch's: the scan in the test lets these through.
NOT_TORCH = {"_exit": "os._exit", "_getframe": "sys._getframe",
             "_get_quantizer": "transformer-engine's tensor (graphstep/fp8/te_interop.py: its test skips without TE)"}


def resolve(path: str):
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module in {path}")


def _member_problem(cls_path: str, members: str) -> Optional[str]:
    cls = resolve(cls_path)
    source = inspect.getsource(inspect.getmodule(cls))
    for member in members.split("|"):
        name = re.escape(member)
        # assigned (``obj.name = ...``, annotated or not), defined (``def name``) or declared (``name: type``)
        if hasattr(cls, member) or re.search(rf"\.{name}\s*(:[^=\n]*)?=|def {name}\b|^\s+{name}\s*:", source, re.M):
            return None
    return "not set anywhere in its module's source"


def problems() -> dict[str, str]:
    """{private name: why it is unusable here} for every listed name this torch lacks (empty: all present)."""
    import torch.distributed  # noqa: F401  (registers the functional collectives' ops)

    found: dict[str, str] = {}
    for path in NAMES:
        try:
            resolve(path)
        except Exception as error:  # ImportError, AttributeError, or an op namespace that raises otherwise
            found[path] = f"{type(error).__name__}: {str(error)[:120]}"
    for cls_path, members in MEMBERS.items():
        for member in members:
            try:
                why = _member_problem(cls_path, member)
            except Exception as error:
                why = f"{type(error).__name__}: {str(error)[:120]}"
            if why:
                found[f"{cls_path}.{member}"] = why
    try:
        from torch._inductor import config as inductor_config

        known = inductor_config.get_config_copy()
        found.update({f"torch._inductor.config.{o}": "no such inductor option" for o in INDUCTOR_OPTIONS
                      if o not in known})
    except Exception as error:
        found["torch._inductor.config"] = f"{type(error).__name__}: {error}"
    try:
        from torch._dynamo import config as dynamo_config

        found.update({f"torch._dynamo.config.{o}": "no such dynamo option" for o in DYNAMO_OPTIONS
                      if not hasattr(dynamo_config, o)})
    except Exception as error:
        found["torch._dynamo.config"] = f"{type(error).__name__}: {error}"
    return found


def optional_missing() -> dict[str, str]:
    """{name: what graphstep does without it} for each ``OPTIONAL`` name this torch lacks."""
    missing = {}
    for path, without in OPTIONAL.items():
        try:
            resolve(path)
        except Exception:  # absent here: graphstep falls back
            missing[path] = without
    return missing


def count() -> int:
    """How many names ``problems()`` and ``optional_missing()`` check."""
    return len(NAMES) + sum(map(len, MEMBERS.values())) + len(INDUCTOR_OPTIONS) + len(DYNAMO_OPTIONS) + len(OPTIONAL)
