"""Every Python block of README.md and of every docs/*.md page runs as written, on small stand-ins for the
names its prose supplies; every relative link of those pages leads somewhere, and every source path they name
exists.

A block's info string says what it needs (GitHub shows only the language, so the tag costs readers
nothing). Each block runs on its own, in a fresh namespace holding only what its tag supplies: a name one
block defines is not seen by the next, so every block is self-contained apart from these.

- ```` ```python ````: a small token model (``model(batch)`` and ``model(inputs, targets)`` return the loss;
  ``model.blocks[i].attn`` has ``q`` / ``k`` Linear weights of 8 heads in 2 query groups of 64), ``data``
  (a few token batches), ``batch`` and an ``opt`` over the model, in a fresh namespace;
- ```` ```python hf ````: a tiny transformers ``GPT2LMHeadModel`` as ``model``, a token dataset as ``data``,
  an ``accelerate.Accelerator`` and a graphstep optimizer over the model;
- ```` ```python lightning ````: the token model and ``data`` as a DataLoader of its batches;
- ```` ```python torchrun ````: a script under torchrun, run here as one gloo rank in a fresh process
  (``sys.argv`` = a checkpoint path and a step count); a block that does not start the process group
  itself gets one, and WORLD as each group it names (``dp_group``, ``edp_group``, ``tp_group``, ``etp_group``,
  ``mp_group``).

Only the sizes a block names for a real job are shrunk (``SHRINK``), and a GPU's device name becomes the
CPU's; each replacement must still match something, so the list cannot go stale. Blocks run in a
temporary working directory (they write checkpoints and ``out/``).
"""

import glob
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphstep as gs
from _ports import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 350  # the front page stays short: details go to a docs/ page
SHRINK = {"hf": [("10_000", "2")], "lightning": [("max_steps=10_000", "max_steps=2")],
          "python": [('"cuda"', '"cpu"')]}


def fences(page: Path) -> list:
    """(info string, first line number, body lines) of every fenced block of ``page``."""
    found, info, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().split("\n"), 1):
        if line.startswith("```"):
            if info is None:
                info, start, body = line[3:].strip(), number + 1, []
            else:
                found.append((info, start, body))
                info = None
        elif info is not None:
            body.append(line)
    return found


def blocks(tag: str, pages=PAGES) -> list:
    """(where, code) of every block whose info string is ``python`` + ``tag``; where = "page:first line"."""
    return [(f"{page.relative_to(ROOT)}:{start}", "\n".join(body)) for page in pages
            for info, start, body in fences(page)
            if info.split()[:1] == ["python"] and " ".join(info.split()[1:]) == tag]


def prose(page: Path) -> str:
    """The page without its fenced blocks: where links and headings live."""
    kept, fenced = [], False
    for line in page.read_text().split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return "\n".join(kept)


def cases(tag: str) -> list:
    return [pytest.param(where, code, id=where) for where, code in blocks(tag)]


def shrunk(code: str, tag: str) -> str:
    for old, new in SHRINK.get(tag or "python", []):
        code = code.replace(old, new)
    return code


def test_the_shrink_list_matches_the_pages():
    for tag, pairs in SHRINK.items():
        text = "\n".join(code for _, code in blocks("" if tag == "python" else tag))
        for old, _ in pairs:
            assert old in text, f"SHRINK[{tag!r}]: {old!r} is in no block any more"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_block_is_tagged_with_a_known_setup(page):
    infos = {info for info, _, _ in fences(page) if info.startswith("python")}
    assert infos <= {"python", "python hf", "python lightning", "python torchrun"}, (page.name, infos)


def test_the_readme_has_each_kind_of_block():
    assert blocks("", [README]) and blocks("torchrun", [README])
    assert blocks("hf") and blocks("lightning")


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move details to a docs/ page and link it"


# ---- links, headings and source paths ---------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    seen, found = {}, set()
    for heading in re.findall(r"^#+ +(.+?) *$", prose(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading(page):
    broken = []
    for target in LINK.findall(re.sub(r"`[^`\n]*`", "", prose(page))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in LINK.findall(prose(README))}
    orphans = [page.name for page in PAGES[1:] if page not in linked]
    assert not orphans, f"README.md links no docs page {orphans}: add it to the Documentation table"


SOURCE_PATH = re.compile(r"(?<![\w./-])((?:graphstep|capture|tests|perf|docs|\.ci)/[\w./<>*-]*)")
NOT_PATHS = {"graphstep/skipped_steps"}  # the metric the Lightning callback logs


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_source_path_named_exists(page):
    missing = []
    for path in SOURCE_PATH.findall(page.read_text()):
        path = path.rstrip(".")
        if path in NOT_PATHS:
            continue
        pattern = re.sub(r"<[^>]*>", "*", path)  # perf/results/bench_fold_units_<shapes>.json
        if not glob.glob(str(ROOT / pattern)):
            missing.append(path)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page):
    cited = re.findall(r"\bissues? #?\d+|(?<![\w&])#\d+\b", prose(page), flags=re.I)
    assert not cited, f"{page.relative_to(ROOT)} cites {cited}: say what the change does instead"


# ---- the default setup: a small token model --------------------------------------------------------

VOCAB, SEQ, WIDTH, HEADS, GROUPS, HEAD_DIM = 64, 8, 512, 8, 2, 64


class Attention(torch.nn.Module):
    """Grouped-query attention with separate q / k / v weights, recording its max logits once registered."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(WIDTH, GROUPS * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(WIDTH, GROUPS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, t, GROUPS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // GROUPS, 1)
        v = self.v(x).view(b, t, GROUPS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // GROUPS, 1)
        scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
        if hasattr(self, "qk_clip_max_logits"):  # registered for QK-clip
            gs.qk_clip.record(self, scores)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.o((attention @ v).transpose(1, 2).reshape(b, t, -1))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.attn = Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class TokenModel(torch.nn.Module):
    """``model(batch)`` (tokens, the last column the targets) or ``model(inputs, targets)``: the mean loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.embed.weight.is_embedding_or_output_parameter = True
        self.head.weight.is_embedding_or_output_parameter = True

    def forward(self, inputs, targets=None):
        if targets is None:
            inputs, targets = inputs[:, :-1], inputs[:, 1:]
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def token_batches(count=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(count)]


def run(code: str, namespace: dict, where: str) -> None:
    exec(compile(code, where, "exec"), namespace)


@pytest.mark.parametrize("where, code", cases(""))
def test_block_runs(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, data = TokenModel(), token_batches()
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture="eager"), model)
    run(shrunk(code, ""), {"torch": torch, "gs": gs, "model": model, "data": data, "batch": data[0],
                           "opt": opt}, where)


# ---- transformers / accelerate ---------------------------------------------------------------------


@pytest.mark.parametrize("where, code", cases("hf"))
def test_hf_block_runs(where, code, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    accelerate = pytest.importorskip("accelerate", reason="the hf extra is not installed")
    import safetensors.torch

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=16))
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    opt = gs.get_optimizer(gs.OptimizerConfig(lr=1e-3, capture="eager"), model)
    run(shrunk(code, "hf"), {"torch": torch, "gs": gs, "transformers": transformers, "safetensors": safetensors,
                             "model": model, "data": data, "opt": opt,
                             "accelerator": accelerate.Accelerator(cpu=True)}, where)


# ---- Lightning -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where, code", cases("lightning"))
def test_lightning_block_runs(where, code, tmp_path, monkeypatch):
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    monkeypatch.chdir(tmp_path)
    data = torch.utils.data.DataLoader(torch.cat(token_batches(4)), batch_size=2)
    run(shrunk(code, "lightning"), {"torch": torch, "gs": gs, "model": TokenModel(), "data": data}, where)


# ---- torchrun scripts: one process, one gloo rank ---------------------------------------------------

_RUNNER = '''
import os, sys, torch, torch.distributed as dist, graphstep as gs
sys.path[:0] = [{root!r}, {tests!r}]  # this checkout's graphstep, whatever is installed
from test_readme import TokenModel, token_batches
for where, code in {blocks!r}:
    model = TokenModel()
    namespace = {{"torch": torch, "dist": dist, "gs": gs, "model": model,
                  "config": gs.OptimizerConfig(use_distributed_optimizer=True),
                  "my_slice_of_each_global_batch": [(b[:, :-1], b[:, 1:]) for b in token_batches()]}}
    if "init_process_group" not in code:
        dist.init_process_group("gloo")
        for name in ("dp_group", "edp_group", "tp_group", "etp_group", "mp_group"):
            namespace[name] = dist.group.WORLD
        model.blocks[1].attn.o.weight.allreduce = False  # an expert param (Megatron-Core's mark)
    exec(compile(code, where, "exec"), namespace)
    dist.destroy_process_group()
    print(f"ran block {{where}}")
'''


@pytest.mark.distributed  # starts a gloo rank in a process of its own, as torchrun would
def test_torchrun_blocks_run_as_one_rank(tmp_path):
    scripts = blocks("torchrun")
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    runner = textwrap.dedent(_RUNNER).format(root=str(ROOT), tests=str(Path(__file__).parent), blocks=scripts)
    done = subprocess.run([sys.executable, "-c", runner, str(tmp_path / "ckpt"), "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ran block") == len(scripts), done.stdout
