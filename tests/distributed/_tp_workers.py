"""What the spawned ranks of test_tensor_parallel.py run: a two-layer MLP split the Megatron way over a
tensor-parallel group (column-parallel, then row-parallel with a replicated bias, then a replicated
LayerNorm), against the same MLP whole in one process."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import graphstep as gs

D, H, BATCH, STEPS = 16, 32, 8, 4
LONG_STEPS, NAN_STEP = 20, 7  # the norm tests' run, and the step whose grads hold a NaN


class _SumOverTensorParallel(torch.autograd.Function):
    """Megatron's reduce-from-tensor-parallel region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = H):
        super().__init__()
        self.up = torch.nn.Linear(D, hidden)
        self.down = torch.nn.Linear(hidden, D)
        self.norm = torch.nn.LayerNorm(D)
        self.unused_offset = torch.nn.Parameter(torch.zeros(D))  # replicated; its grad is all zeros (num_zeros)
        self.tp = False
        self.tp_group = None  # None: WORLD

    def forward(self, x):
        partial = torch.nn.functional.linear(torch.nn.functional.gelu(self.up(x)), self.down.weight)
        if self.tp:
            partial = _SumOverTensorParallel.apply(partial, self.tp_group)
        return self.norm(partial + self.down.bias) + 0.0 * self.unused_offset


def whole_model() -> MLP:
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.1, 0.1)
    return model


def tp_slice(whole: MLP, rank: int, world: int) -> MLP:
    """This rank's part of ``whole``: ``up`` split by rows (its weight and bias), ``down`` by columns; the
    ``down`` bias and the LayerNorm replicated. Megatron's marks on the split params."""
    part = MLP(H // world)
    rows = slice(rank * H // world, (rank + 1) * H // world)
    with torch.no_grad():
        part.up.weight.copy_(whole.up.weight[rows])
        part.up.bias.copy_(whole.up.bias[rows])
        part.down.weight.copy_(whole.down.weight[:, rows])
        part.down.bias.copy_(whole.down.bias)
        part.norm.load_state_dict(whole.norm.state_dict())
        part.unused_offset.copy_(whole.unused_offset)
    for p, dim in ((part.up.weight, 0), (part.up.bias, 0), (part.down.weight, 1)):
        p.tensor_model_parallel, p.partition_dim = True, dim
    part.tp = world > 1
    return part


def batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(100 + step))


def train(model: MLP, capture: str, nan_into=None, extra: Optional[dict] = None, **groups) -> dict:
    """LONG_STEPS steps; at NAN_STEP a NaN is written into ``nan_into(model)``'s grad (None: nowhere).
    ``extra``: more OptimizerConfig fields."""
    config = gs.OptimizerConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.0, capture=capture, capture_warmup_steps=1,
                                log_num_zeros_in_grad=True, kernel="fused", **(extra or {}))
    opt = gs.get_optimizer(config, model, **groups)
    norms, zeros, applied = [], [], []
    for step in range(LONG_STEPS):
        opt.zero_grad()
        model(batch(step)).square().mean().backward()
        if step == NAN_STEP and nan_into is not None:
            nan_into(model).grad[0] = float("nan")
        result = opt.step()
        applied.append(bool(result.update_successful))
        if step != NAN_STEP:
            norms.append(float(result.grad_norm))
            zeros.append(int(result.num_zeros))
    return {"norms": norms, "zeros": zeros, "applied": applied, "captured": opt.captured}


def tensor_parallel(rank: int, world: int, extra: Optional[dict] = None) -> dict:
    """The split MLP trained over WORLD as the tensor-parallel group, eager and captured, and the whole one in
    this process. At NAN_STEP the last rank alone gets a NaN in the LayerNorm's weight grad: a replicated
    param, which that rank does not count in the norm, yet the step must be skipped on every rank. ``extra``:
    more OptimizerConfig fields for the split runs (e.g. CPU offload)."""
    whole = whole_model()
    reference = train(whole, "eager", nan_into=lambda m: m.norm.weight)
    nan_here = (lambda m: m.norm.weight) if rank == world - 1 else None
    parts, found = {}, {}
    for capture in ("eager", "graph"):
        parts[capture] = tp_slice(whole_model(), rank, world)
        found[capture] = train(parts[capture], capture, nan_into=nan_here, extra=extra,
                               tensor_parallel_group=dist.group.WORLD)
    part = parts["graph"]
    rows = slice(rank * H // world, (rank + 1) * H // world)
    pairs = ((part.up.weight, whole.up.weight[rows]), (part.up.bias, whole.up.bias[rows]),
             (part.down.weight, whole.down.weight[:, rows]), (part.down.bias, whole.down.bias),
             (part.norm.weight, whole.norm.weight), (part.norm.bias, whole.norm.bias))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    bitwise = all(torch.equal(a, b) for a, b in zip(parts["eager"].parameters(), parts["graph"].parameters()))
    return {"reference": reference, "found": found, "worst_param_error": worst, "captured_equals_eager": bitwise}


def refusals(rank: int, world: int) -> dict:
    """What get_optimizer and the reshardable checkpoint refuse under tensor parallelism, by message."""
    found = {}
    try:
        gs.get_optimizer(gs.OptimizerConfig(capture="eager"), tp_slice(whole_model(), rank, world),
                         model_parallel_group=dist.group.WORLD)
        found["marks"] = "built"
    except ValueError as error:
        found["marks"] = str(error)
    experts = tp_slice(whole_model(), rank, world)
    experts.down.weight.allreduce = False  # an expert param (Megatron-Core's mark)
    try:
        gs.get_optimizer(gs.OptimizerConfig(capture="eager", use_distributed_optimizer=True), experts,
                         expert_data_parallel_group=dist.group.WORLD, tensor_parallel_group=dist.group.WORLD)
        found["experts"] = "built"
    except ValueError as error:
        found["experts"] = str(error)
    alone = [dist.new_group([r]) for r in range(world)][rank]
    for key, optimizer, model in (("muon_experts", "muon", experts),
                                  ("expert_group_without_experts", "adam", tp_slice(whole_model(), rank, world))):
        try:  # one data-parallel rank: the experts join the dense layout, whose TP group is not theirs
            opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager", optimizer=optimizer), model,
                                   tensor_parallel_group=dist.group.WORLD, expert_tensor_parallel_group=alone)
            model(batch(0)).square().mean().backward()
            opt.step()
            found[key] = "stepped"
        except ValueError as error:
            found[key] = str(error)
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="eager"), tp_slice(whole_model(), rank, world),
                           tensor_parallel_group=dist.group.WORLD)
    try:
        gs.checkpoint.save(opt, "/nonexistent/never-written")
        found["checkpoint"] = "saved"
    except NotImplementedError as error:
        found["checkpoint"] = str(error)
    return found


def tensor_and_data_parallel(rank: int, world: int, capture: str, overlap: bool = False,
                             optimizer: str = "adam") -> dict:
    """TP = 2 x DP = 2 on 4 ranks: TP groups {0, 1} and {2, 3}, data-parallel groups {0, 2} and {1, 3} with
    the distributed optimizer; each data-parallel rank its own batch. The reference is the whole model in
    this process over both batches' mean loss (what the data-parallel average of the grads computes).
    ``overlap``: the reduce-scatters start from backward hooks (``overlap_grad_reduce``, eager steps).
    ``optimizer="muon"``: the two matrices split over TP are also sharded layer-wise over DP (whole slices per
    data-parallel rank), Muon on the whole matrices (``muon_tp_mode="duplicated"``)."""
    tp_size = 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % tp_size, rank // tp_size
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]

    def loss(model, step, dp):
        return model(batch(10 * step + dp)).square().mean()

    config = dict(lr=1e-2, clip_grad=0.05, weight_decay=0.0, capture_warmup_steps=1, log_num_zeros_in_grad=True,
                  kernel="fused", optimizer=optimizer, muon_fp32_matmul_prec="highest",
                  muon_tp_mode="duplicated")
    whole = whole_model()
    reference = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **config), whole)
    part = tp_slice(whole_model(), tp_rank, tp_size)
    part.tp_group = tp_group
    opt = gs.get_optimizer(gs.OptimizerConfig(capture=capture, use_distributed_optimizer=True,
                                              overlap_grad_reduce=overlap, **config), part,
                           process_group=dp_group, tensor_parallel_group=tp_group)
    found, expected = [], []
    for step in range(LONG_STEPS):
        reference.zero_grad()
        (sum(loss(whole, step, dp) for dp in range(2)) / 2).backward()
        result = reference.step()
        expected.append((float(result.grad_norm), int(result.num_zeros)))
        opt.zero_grad()
        loss(part, step, dp_rank).backward()
        result = opt.step()
        found.append((float(result.grad_norm), int(result.num_zeros)))
    rows = slice(tp_rank * H // tp_size, (tp_rank + 1) * H // tp_size)
    pairs = ((part.up.weight, whole.up.weight[rows]), (part.down.weight, whole.down.weight[:, rows]),
             (part.down.bias, whole.down.bias), (part.norm.weight, whole.norm.weight))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    return {"found": found, "expected": expected, "worst_param_error": worst, "captured": opt.captured,
            "overlapped": sum(opt.overlap_counts.values())}


def _muon_config(mode: str, capture: str) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(optimizer="muon", lr=2e-2, weight_decay=0.0, clip_grad=0.0, muon_tp_mode=mode,
                              muon_fp32_matmul_prec="highest", capture=capture, capture_warmup_steps=1)


def muon_tensor_parallel(rank: int, world: int, mode: str, capture: str) -> dict:
    """Muon over the split MLP (its two matrices split over WORLD as the TP group) against Muon over the
    whole MLP in this process; for "blockwise", the first step against Newton–Schulz of each slice alone."""
    from graphstep.kernels.muon import scale_factor
    from graphstep.kernels.newton_schulz import newton_schulz

    whole = whole_model()
    part = tp_slice(whole_model(), rank, world)
    rows = slice(rank * H // world, (rank + 1) * H // world)
    reference = gs.get_optimizer(_muon_config(mode, "eager"), whole)
    opt = gs.get_optimizer(_muon_config(mode, capture), part, tensor_parallel_group=dist.group.WORLD)
    first_step = None
    for step in range(STEPS):
        for model, optimizer in ((whole, reference), (part, opt)):
            optimizer.zero_grad()
            model(batch(step)).square().mean().backward()
        if step == 0:  # what one blockwise step does to each slice: Newton–Schulz of (1 - μ)·g alone
            expected = {}
            for name, p, full_shape in (("up", part.up.weight, whole.up.weight.shape),
                                        ("down", part.down.weight, whole.down.weight.shape)):
                update = (1 - 0.95) * p.grad.detach().float()
                orth = newton_schulz(update.unsqueeze(0), num_steps=5, fp32_matmul_prec="highest")[0]
                expected[name] = p.detach() - 2e-2 * orth * scale_factor(*full_shape, "spectral")
        reference.step()
        opt.step()
        if step == 0:
            first_step = max(float((p.detach() - expected[name]).abs().max() / expected[name].abs().max())
                             for name, p in (("up", part.up.weight), ("down", part.down.weight)))
    pairs = ((part.up.weight, whole.up.weight[rows]), (part.down.weight, whole.down.weight[:, rows]),
             (part.down.bias, whole.down.bias), (part.norm.weight, whole.norm.weight))
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    return {"worst_vs_whole": worst, "blockwise_first_step": first_step, "captured": opt.captured}


# ---- QK-clip over heads split across the tensor-parallel ranks ---------------------------------------------
HIDDEN, SEQ, HEADS, GROUPS, HEAD_DIM, THRESHOLD = 24, 6, 8, 2, 4, 10.0


class Attention(torch.nn.Module):
    """GQA attention; with ``tp_world`` > 1, this rank's heads and groups (column-parallel Q, K, V, row-parallel
    output): each TP rank holds HEADS / tp_world heads of GROUPS / tp_world groups."""

    def __init__(self, tp_world: int = 1, tp_rank: int = 0):
        super().__init__()
        from graphstep.step.qk_clip import HeadLayout

        torch.manual_seed(0)
        whole = {name: torch.nn.Linear(HIDDEN, rows * HEAD_DIM, bias=False).weight.detach()
                 for name, rows in (("q", HEADS), ("k", GROUPS), ("v", GROUPS))}
        whole["out"] = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False).weight.detach()
        with torch.no_grad():  # logits of ~10-50: some groups cross the threshold on some steps
            whole["q"] = whole["q"] * torch.linspace(2.0, 12.0, HEADS).repeat_interleave(HEAD_DIM)[:, None]
        self.heads, self.groups = HEADS // tp_world, GROUPS // tp_world
        self.tp = tp_world > 1

        def rows_of(name, count):
            size = count * HEAD_DIM
            return whole[name][tp_rank * size:(tp_rank + 1) * size]

        self.q = torch.nn.Parameter(rows_of("q", self.heads).clone())
        self.k = torch.nn.Parameter(rows_of("k", self.groups).clone())
        self.v = torch.nn.Parameter(rows_of("v", self.groups).clone())
        cols = slice(tp_rank * self.heads * HEAD_DIM, (tp_rank + 1) * self.heads * HEAD_DIM)
        self.out = torch.nn.Parameter(whole["out"][:, cols].clone())
        for p, dim in ((self.q, 0), (self.k, 0), (self.v, 0), (self.out, 1)):
            p.tensor_model_parallel, p.partition_dim = True, dim
        gs.qk_clip.register(self, layout=HeadLayout(self.heads, self.groups, HEAD_DIM), q=self.q, k=self.k)

    def forward(self, x):
        b = x.shape[0]
        q = (x @ self.q.T).view(b, SEQ, self.heads, HEAD_DIM).transpose(1, 2)
        k, v = ((x @ w.T).view(b, SEQ, self.groups, HEAD_DIM).transpose(1, 2)
                .repeat_interleave(self.heads // self.groups, dim=1) for w in (self.k, self.v))
        scores = q @ k.mT * HEAD_DIM ** -0.5
        gs.qk_clip.record(self, scores)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, SEQ, -1) @ self.out.T
        return _SumOverTensorParallel.apply(y, None) if self.tp else y


def qk_clip_tensor_parallel(rank: int, world: int) -> dict:
    """lr 0, so only QK-clip moves W_q and W_k: the split attention (captured) against the whole one."""
    runs = {}
    alone = dist.new_group([rank], use_local_synchronization=True)  # the whole attention: not split, marked anyway
    for name, model, tp_group in (("whole", Attention(), alone), ("part", Attention(world, rank), dist.group.WORLD)):
        config = gs.OptimizerConfig(lr=0.0, weight_decay=0.0, qk_clip=True, qk_clip_threshold=THRESHOLD,
                                    capture="eager" if name == "whole" else "graph", capture_warmup_steps=1)
        opt = gs.get_optimizer(config, model, tensor_parallel_group=tp_group)
        maxima = []
        for step in range(STEPS):
            opt.zero_grad()
            x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            maxima.append(model.qk_clip_max_logits.clone())
            opt.step()
        runs[name] = (model, maxima, opt.captured)
    whole, whole_maxima, _ = runs["whole"]
    part, part_maxima, captured = runs["part"]
    heads = slice(rank * HEADS // world, (rank + 1) * HEADS // world)
    q_rows = slice(rank * HEADS // world * HEAD_DIM, (rank + 1) * HEADS // world * HEAD_DIM)
    k_rows = slice(rank * GROUPS // world * HEAD_DIM, (rank + 1) * GROUPS // world * HEAD_DIM)
    return {"captured": captured,
            "q_error": float((part.q - whole.q[q_rows]).abs().max()),
            "k_error": float((part.k - whole.k[k_rows]).abs().max()),
            "q_moved": float((whole.q - Attention().q).abs().max()),
            "maxima_error": max(float((a - b[heads]).abs().max()) for a, b in zip(part_maxima, whole_maxima))}


# ---- two pipeline stages sharing the embedding ------------------------------------------------------------------
VOCAB = 12


class Stage(torch.nn.Module):
    """Stage 0: the embedding and a first layer. Stage 1: a second layer and the output projection, which is a
    copy of the embedding marked ``shared=True`` (Megatron's pipeline layout of tied embeddings)."""

    def __init__(self, stage: int, embedding: torch.Tensor, first: torch.nn.Linear, second: torch.nn.Linear):
        super().__init__()
        self.stage = stage
        if stage == 0:
            self.embed = torch.nn.Parameter(embedding.clone())
            self.layer = torch.nn.Linear(D, D)
            self.layer.load_state_dict(first.state_dict())
        else:
            self.layer = torch.nn.Linear(D, D)
            self.layer.load_state_dict(second.state_dict())
            self.output = torch.nn.Parameter(embedding.clone())
            self.output.shared = True


class Tied(torch.nn.Module):
    def __init__(self, embedding, first, second):
        super().__init__()
        self.embed = torch.nn.Parameter(embedding.clone())
        self.first, self.second = first, second

    def forward(self, tokens):
        return torch.nn.functional.linear(torch.tanh(self.second(torch.tanh(self.first(self.embed[tokens])))),
                                          self.embed)


def pipeline_with_shared_embedding(rank: int, world: int) -> dict:
    """Rank r is pipeline stage r; the two ranks form the model-parallel group. Each step: stage 0's forward,
    its activations to stage 1, stage 1's forward and backward, the activations' grad back, stage 0's backward,
    then the embedding copies' grads summed over both stages (Megatron's embedding-group all-reduce)."""
    torch.manual_seed(0)
    embedding = torch.randn(VOCAB, D) * 0.5
    first, second = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
    whole = Tied(embedding, first, second)
    stage = Stage(rank, embedding, first, second)
    config = dict(lr=1e-2, clip_grad=0.05, weight_decay=0.0, kernel="fused")
    reference = gs.get_optimizer(gs.OptimizerConfig(capture="eager", **config), whole)
    opt = gs.get_optimizer(gs.OptimizerConfig(capture="graph", capture_warmup_steps=1, **config), stage,
                           model_parallel_group=dist.group.WORLD)
    norms, expected = [], []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(step))
        reference.zero_grad()
        whole(tokens).square().mean().backward()
        expected.append(float(reference.step().grad_norm))
        opt.zero_grad()
        if rank == 0:
            hidden = torch.tanh(stage.layer(stage.embed[tokens]))
            dist.send(hidden.detach().contiguous(), 1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, 1)
            hidden.backward(grad)
            shared_grad = stage.embed.grad
        else:
            hidden = torch.empty(4, 5, D)
            dist.recv(hidden, 0)
            hidden.requires_grad_(True)
            logits = torch.nn.functional.linear(torch.tanh(stage.layer(hidden)), stage.output)
            logits.square().mean().backward()
            dist.send(hidden.grad.contiguous(), 0)
            shared_grad = stage.output.grad
        dist.all_reduce(shared_grad)  # both copies now hold the tied weight's whole grad
        norms.append(float(opt.step().grad_norm))
    copy = stage.embed if rank == 0 else stage.output
    layer = whole.first if rank == 0 else whole.second
    worst = max(float((copy - whole.embed).abs().max()), float((stage.layer.weight - layer.weight).abs().max()))
    return {"norms": norms, "expected": expected, "worst_param_error": worst, "captured": opt.captured}


class FusedQKV(torch.nn.Module):
    """Megatron's fused QKV weight, GQA: per query group its heads' Q rows, then its K rows, then its V rows;
    split over TP by query groups (column-parallel). Muon orthogonalises Q, K and V as three matrices."""

    def __init__(self, tp_world: int = 1, tp_rank: int = 0):
        super().__init__()
        torch.manual_seed(0)
        per_group = (HEADS // GROUPS + 2) * HEAD_DIM
        whole = torch.randn(GROUPS * per_group, HIDDEN) * 0.2
        self.groups = GROUPS // tp_world
        rows = slice(tp_rank * self.groups * per_group, (tp_rank + 1) * self.groups * per_group)
        self.qkv = torch.nn.Parameter(whole[rows].clone())
        self.qkv.qkv_split = gs.QKVSplit(self.groups, HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM)
        self.qkv.tensor_model_parallel, self.qkv.partition_dim = True, 0
        self.tp = tp_world > 1

    def forward(self, x):
        out = x @ self.qkv.T  # (b, s, local rows): a stand-in loss over every row
        loss_rows = out.square().sum(-1, keepdim=True)
        return _SumOverTensorParallel.apply(loss_rows, None) if self.tp else loss_rows


def muon_fused_qkv_tensor_parallel(rank: int, world: int, mode: str) -> dict:
    per_group = (HEADS // GROUPS + 2) * HEAD_DIM
    rows = slice(rank * GROUPS // world * per_group, (rank + 1) * GROUPS // world * per_group)
    whole, part = FusedQKV(), FusedQKV(world, rank)
    alone = dist.new_group([rank], use_local_synchronization=True)  # the whole weight: not split, marked anyway
    reference = gs.get_optimizer(_muon_config(mode, "eager"), whole, tensor_parallel_group=alone)
    opt = gs.get_optimizer(_muon_config(mode, "graph"), part, tensor_parallel_group=dist.group.WORLD)
    for step in range(STEPS):
        x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((whole, reference), (part, opt)):
            optimizer.zero_grad()
            model(x).mean().backward()
            optimizer.step()
    return {"error": float((part.qkv - whole.qkv[rows]).abs().max() / whole.qkv.abs().max()),
            "moved": float((whole.qkv - FusedQKV().qkv).abs().max()), "captured": opt.captured}
