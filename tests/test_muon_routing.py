"""Muon routing on models without Megatron's marks (Hugging Face, plain torch): embeddings, weights tied to
them and params named like embeddings or output heads go to the scalar optimizer; a fused QKV weight whose
head layout is unknown is refused at build (torch's MultiheadAttention, whose layout is known, is split);
the routing is logged once per build. Megatron-marked models route by their marks alone, as before.

The oracle for the inferred routing is Megatron-Core's rule on the same model with its marks set by hand
(``is_embedding_or_output_parameter`` on the embeddings and the head): same groups, and training both gives
bitwise-equal params."""

import logging

import pytest
import torch
from toy import tiny_transformer

import graphstep as gs
from graphstep.plan.routing import build_family_param_groups

FUSED_C_ATTN = gs.ParamKey(name="*c_attn.weight")


def muon_config(**changes) -> gs.OptimizerConfig:
    return gs.OptimizerConfig(**{**dict(optimizer="muon", lr=0.01, weight_decay=0.01, kernel="reference",
                                        muon_fp32_matmul_prec="highest"), **changes})


def families_by_name(param_groups) -> dict[str, str]:
    return {name: group["optimizer"] for group in param_groups for name in group["param_names"]}


def tiny_gpt2(tied: bool = True, seed: int = 0):
    transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need transformers "
                                                              "(the 'hf' extra)")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def adam_for_c_attn(config) -> dict:
    """The way out the refusal names: the standard overrides plus the fused weights routed to Adam."""
    return {**gs.get_standard_config_overrides(config), FUSED_C_ATTN: {"optimizer": "adam"}}


def gpt2_loss(model) -> torch.Tensor:
    """The next-token loss on one fixed batch (so a few steps must lower it)."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return model(input_ids=tokens, labels=tokens).loss


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = gpt2_loss(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------- Hugging Face GPT-2

def test_gpt2_embeddings_and_tied_head_go_to_the_scalar_optimizer():
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: named_parameters() lists it once
    config = muon_config()
    opt = gs.get_optimizer(config, model, config_overrides=adam_for_c_attn(config))
    family = families_by_name(opt.param_groups)
    assert family["transformer.wte.weight"] == "adam" and family["transformer.wpe.weight"] == "adam"
    muon = {name for name, f in family.items() if f == "muon"}
    assert muon == {f"transformer.h.{i}.{w}.weight" for i in range(2)
                    for w in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert all(f == "adam" for name, f in family.items() if name not in muon)


def test_gpt2_untied_head_goes_to_the_scalar_optimizer_by_its_name():
    model = tiny_gpt2(tied=False)
    config = muon_config()
    family = families_by_name(gs.get_optimizer(config, model, config_overrides=adam_for_c_attn(config)).param_groups)
    assert family["lm_head.weight"] == "adam"


def test_gpt2_routing_equals_megatrons_rule_with_the_marks_set_by_hand_bitwise_over_training():
    config = muon_config()
    inferred, marked = tiny_gpt2(), tiny_gpt2()
    for p in (marked.transformer.wte.weight, marked.transformer.wpe.weight):
        p.is_embedding_or_output_parameter = True
    inferred_opt = gs.get_optimizer(config, inferred, config_overrides=adam_for_c_attn(config))
    marked_opt = gs.get_optimizer(config, marked, config_overrides=adam_for_c_attn(config))
    assert [(g["optimizer"], g["param_names"]) for g in inferred_opt.param_groups] == \
        [(g["optimizer"], g["param_names"]) for g in marked_opt.param_groups]
    losses = train(inferred, inferred_opt, 3)
    assert losses == train(marked, marked_opt, 3)
    for a, b in zip(inferred.parameters(), marked.parameters()):
        assert torch.equal(a, b)


def test_gpt2_fused_c_attn_is_refused_at_build_naming_the_param_and_the_ways_out():
    with pytest.raises(ValueError) as refused:
        gs.get_optimizer(muon_config(), tiny_gpt2())
    message = str(refused.value)
    for words in ("transformer.h.0.attn.c_attn.weight", "fused QKV", "columns", "'optimizer': 'adam'",
                  "muon_split_qkv=False"):
        assert words in message, (words, message)
    gs.get_optimizer(muon_config(muon_split_qkv=False), tiny_gpt2())  # the user's explicit choice: built


def test_gpt2_with_c_attn_routed_to_adam_trains_with_a_finite_falling_loss():
    model = tiny_gpt2()
    config = muon_config(lr=0.02, capture="graph", capture_warmup_steps=1)
    opt = gs.get_optimizer(config, model, config_overrides=adam_for_c_attn(config))
    assert families_by_name(opt.param_groups)["transformer.h.0.attn.c_attn.weight"] == "adam"
    losses = train(model, opt, 6)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert opt.captured


def test_gpt2_routing_is_logged_once_as_a_warning_naming_the_families(caplog):
    model = tiny_gpt2()
    config = muon_config()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        gs.get_optimizer(config, model, config_overrides=adam_for_c_attn(config))
    routing = [r for r in caplog.records if "routing" in r.getMessage()]
    assert len(routing) == 1, [r.getMessage() for r in caplog.records]
    message = routing[0].getMessage()
    assert routing[0].levelno == logging.WARNING  # seen without configuring logging (logging.lastResort)
    assert "muon 6 params" in message and "adam 22 params" in message, message
    assert "transformer.wte.weight" in message and "transformer.wpe.weight" in message, message


# ---------------------------------------------------------------- plain torch models

def test_plain_embedding_goes_to_adam_and_the_linear_to_muon():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    groups = build_family_param_groups(list(model.named_parameters()), muon_config(), model_chunks=model)
    family = families_by_name(groups)
    assert family["0.weight"] == "adam"  # found by its module's type: the name says nothing
    assert family["1.weight"] == "muon" and family["2.weight"] == "muon"
    assert family["1.bias"] == "adam"


def test_a_weight_tied_to_an_embedding_goes_with_it_and_the_log_names_the_tie(caplog):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(16, 8)
            self.hidden = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 16, bias=False)
            self.out.weight = self.tokens.weight

    model = Tied()
    with caplog.at_level(logging.INFO, logger="graphstep"):
        groups = build_family_param_groups(list(model.named_parameters()), muon_config(), model_chunks=model)
    assert families_by_name(groups) == {"tokens.weight": "adam", "hidden.weight": "muon", "hidden.bias": "adam"}
    assert "out.weight" in caplog.text  # the tie, named in the routing line


def test_an_embedding_named_module_goes_to_adam_through_get_optimizer():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(16, 8)
            self.proj = torch.nn.Linear(8, 8)

    family = families_by_name(gs.get_optimizer(muon_config(), Model()).param_groups)
    assert family == {"embed_tokens.weight": "adam", "proj.weight": "muon", "proj.bias": "adam"}


def test_torch_multihead_attention_in_proj_is_split_as_q_k_v():
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    gs.get_optimizer(muon_config(), model)
    assert model.self_attn.in_proj_weight.qkv_split == gs.QKVSplit(1, 8, 8, 8)  # torch's [W_q; W_k; W_v]


def test_a_fused_qkv_linear_of_unknown_layout_is_refused_and_its_split_or_an_override_builds():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24, bias=False)
            self.proj = torch.nn.Linear(8, 8, bias=False)

    with pytest.raises(ValueError, match=r"'qkv.weight'.*qkv_split = graphstep.QKVSplit"):
        gs.get_optimizer(muon_config(), Attention())
    marked = Attention()
    marked.qkv.weight.qkv_split = gs.QKVSplit(1, 8, 8, 8)
    assert families_by_name(gs.get_optimizer(muon_config(), marked).param_groups)["qkv.weight"] == "muon"
    routed = gs.get_optimizer(muon_config(), Attention(),
                              config_overrides={gs.ParamKey(name="qkv.weight"): {"optimizer": "adam"}})
    assert families_by_name(routed.param_groups) == {"qkv.weight": "adam", "proj.weight": "muon"}


# ---------------------------------------------------------------- Megatron-marked models: as before

def test_a_megatron_marked_model_routes_by_its_marks_alone_and_logs_at_info(caplog):
    model = tiny_transformer()  # embedding and head marked; torch's in_proj_weight without a split
    model.add_module("embedder", torch.nn.Linear(64, 64, bias=False))  # named like one, but unmarked
    with caplog.at_level(logging.INFO, logger="graphstep"):
        opt = gs.get_optimizer(muon_config(), model)
    family = families_by_name(opt.param_groups)
    assert family["embedder.weight"] == "muon" and family["1.self_attn.in_proj_weight"] == "muon"
    assert family["0.weight"] == "adam" and family["3.weight"] == "adam"
    assert getattr(model[1].self_attn.in_proj_weight, "qkv_split", None) is None  # no split added
    routing = [r for r in caplog.records if "routing" in r.getMessage()]
    assert len(routing) == 1 and routing[0].levelno == logging.INFO


def test_get_optimizer_routes_a_plain_embedding_by_its_module_type():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))
    family = families_by_name(gs.get_optimizer(muon_config(), model).param_groups)
    assert family == {"0.weight": "adam", "1.weight": "muon", "1.bias": "adam", "2.weight": "muon",
                      "2.bias": "adam"}
