"""Distillation on a tiny random model: the student's shape, the loss going down, only the chosen layers
training, and the saved student served by the engine exactly as transformers runs it."""

import pytest
import torch
import torch.nn.functional as F

from hf_reference import hf_greedy, load_hf
from minillm import LLM, SamplingParams, distill
from tiny_models import CORPUS


@pytest.fixture(scope="module")
def setup(tiny_llama):
    teacher = distill.load_teacher(tiny_llama)
    tokenizer = LLM(tiny_llama, device="cpu", num_kv_blocks=16).get_tokenizer()
    windows = distill.token_windows(tokenizer(" ".join(CORPUS)).input_ids, 16)
    return teacher, windows, distill.teacher_targets(teacher, windows, top_k=16)


def loss_of(student, windows, targets):
    with torch.no_grad():
        return float(distill.distill_loss(student(windows).logits, targets))


def test_dropping_layers_renumbers_the_rest(setup):
    teacher, windows, _ = setup
    student = distill.drop_layers(teacher, [0])
    assert student.config.num_hidden_layers == 1 and teacher.config.num_hidden_layers == 2
    assert student.model.layers[0].self_attn.layer_idx == 0
    mine, theirs = student.model.layers[0].mlp.down_proj.weight, teacher.model.layers[1].mlp.down_proj.weight
    assert mine is not theirs and torch.equal(mine, theirs)  # a copy: training the student leaves the teacher
    assert student(windows[:1]).logits.shape == (1, 16, teacher.config.vocab_size)
    assert distill.layer_redundancy(teacher, windows[:2]).shape == (2,)


def test_neighbours_are_student_indices_of_the_layers_beside_a_cut():
    # teacher layers 0..9 without 3 and 4: student layers are 0,1,2,5,6,... -> teacher 2 and 5 sit beside the cut
    assert distill.neighbours([3, 4], 10) == [2, 3]
    assert distill.neighbours([0], 4) == [0]
    assert distill.neighbours([2, 6], 8) == [1, 2, 4, 5]


def test_loss_is_the_kl_divergence_with_the_tail_lumped_together(setup):
    teacher, windows, _ = setup
    student = distill.drop_layers(teacher, [1])
    with torch.no_grad():
        s, t = student(windows).logits, teacher(windows).logits
        full = F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), log_target=True, reduction="none")
        full = full.sum(-1).mean() * 4
        every = distill.teacher_targets(teacher, windows, top_k=teacher.config.vocab_size, temperature=2.0)
        top = distill.teacher_targets(teacher, windows, top_k=16, temperature=2.0)
        torch.testing.assert_close(distill.distill_loss(s, every), full, atol=1e-5, rtol=1e-5)
        assert 0 < distill.distill_loss(s, top) < full  # lumping outcomes together can only hide differences


def test_a_few_steps_lower_the_distillation_loss(setup):
    teacher, windows, targets = setup
    student = distill.drop_layers(teacher, [1])
    before = loss_of(student, windows, targets)
    result = distill.distill(student, windows, targets, steps=12, lr=3e-3, batch_size=2)
    assert result.steps == len(result.losses) == 12 and result.seconds > 0
    assert loss_of(student, windows, targets) < 0.8 * before
    assert loss_of(teacher, windows, targets) < 1e-3  # the teacher is its own best student


def test_only_the_chosen_layers_train(setup):
    teacher, windows, targets = setup
    student = distill.drop_layers(teacher, [1])
    frozen = {n: p.clone() for n, p in student.named_parameters() if not n.startswith("model.layers.0.")}
    trained = student.model.layers[0].mlp.up_proj.weight.clone()
    soft = distill.teacher_targets(teacher, windows, top_k=16, temperature=2.0)
    result = distill.distill(student, windows, soft, steps=3, lr=1e-3, train_layers=[0], ce_weight=0.5)
    assert result.trained_layers == [0]
    assert all(torch.equal(p, frozen[n]) for n, p in student.named_parameters() if n in frozen)
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, trained)


def test_saved_student_runs_in_the_engine_as_in_transformers(setup, tiny_llama, tmp_path):
    teacher, windows, targets = setup
    student = distill.drop_layers(teacher, [0])
    distill.distill(student, windows, targets, steps=4, lr=1e-3)
    path = distill.save_student(student, tmp_path / "student", tokenizer_from=tiny_llama)
    llm = LLM(path, device="cpu", dtype=torch.float32, num_kv_blocks=64, block_size=4)
    assert llm.engine.config.num_layers == 1
    hf = load_hf(path)
    torch.testing.assert_close(hf.model.layers[0].mlp.up_proj.weight, student.model.layers[0].mlp.up_proj.weight)
    prompts = ["The quick brown fox", "Prefill builds the cache; decode reads it."]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected, _ = hf_greedy(hf, llm.get_tokenizer()(prompt).input_ids, 10)
        assert out.outputs[0].token_ids == expected


def test_bad_arguments_are_refused(setup):
    teacher, windows, targets = setup
    for layers in ([], [2], [0, 1], [-1]):
        with pytest.raises(ValueError, match="layers to drop"):
            distill.drop_layers(teacher, layers)
    with pytest.raises(ValueError, match="window length"):
        distill.token_windows([1, 2, 3], 1)
    with pytest.raises(ValueError, match="do not fill one window"):
        distill.token_windows([1, 2, 3], 4)
    student = distill.drop_layers(teacher, [1])
    with pytest.raises(ValueError, match="steps"):
        distill.distill(student, windows, targets)
    with pytest.raises(ValueError, match="targets cover"):
        distill.distill(student, windows[:2], targets, steps=1)
    with pytest.raises(ValueError, match="train_layers"):
        distill.distill(student, windows, targets, steps=1, train_layers=[1])
    with pytest.raises(ValueError, match="top_k"):
        distill.teacher_targets(teacher, windows, top_k=0)
    with pytest.raises(ValueError, match="temperature"):
        distill.teacher_targets(teacher, windows, temperature=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        distill.distill(student, windows, targets, steps=1, batch_size=0)
    assert distill.distill(student, windows, targets, seconds=0.0).steps == 0
