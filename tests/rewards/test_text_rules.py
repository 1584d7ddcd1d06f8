"""Text rule rewards against hand-computed references."""

import math
import re
import threading
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgrpo.rewards import RewardBatch, build_reward, text_rules
from mmgrpo.rewards.text_rules import (
    answer_diversity,
    canonical_problem_type,
    last_tagged,
    last_tagged_span,
    math_equal,
    normalize_choice,
    parse_interval,
    parse_number,
    unwrap_answer,
)


def text_batch(completions, meta=None):
    n = len(completions)
    return RewardBatch(prompts=["q"] * n, group=torch.zeros(n, dtype=torch.long), completions=list(completions),
                       meta=meta or [])


def score(name, completions, meta=None, **args):
    return build_reward(name, args)(text_batch(completions, meta)).tolist()


# ---------------------------------------------------------------- format

@pytest.mark.parametrize("text, expected", [
    ("<think>a</think><answer>B</answer>", 1.0),
    ("\n  <think>\nstep 1\nstep 2\n</think>\n\n<answer> B </answer>\n", 1.0),
    ("<think></think><answer>B</answer>", 1.0),  # an empty think block is still the format
    ("", 0.0),
    ("<answer>B</answer>", 0.0),  # no think block
    ("Sure! <think>a</think><answer>B</answer>", 0.0),  # text before
    ("<think>a</think><answer>B</answer> done", 0.0),  # text after
    ("<think>a</think><answer>A</answer><answer>B</answer>", 0.0),  # two answers
    ("<think>a</think><answer>  </answer>", 0.0),  # blank answer
    ("<think>a <answer>A</answer></think><answer>B</answer>", 0.0),  # answer tag inside think
    ("<think>a</think> middle <answer>B</answer>", 0.0),
    ("<answer>B</answer><think>a</think>", 0.0),  # wrong order
])
def test_format_strict(text, expected):
    assert score("format", [text]) == [expected]


@pytest.mark.parametrize("text, expected", [
    ("<answer>B</answer>", 1.0),
    ("The red ball is left of the cube, so B.\n<answer>B</answer>\n", 1.0),
    ("<think>a</think><answer>B</answer>", 1.0),
    ("", 0.0),
    ("B", 0.0),
    ("<answer>B</answer> trailing", 0.0),
    ("<answer>A</answer> <answer>B</answer>", 0.0),
    ("<answer></answer>", 0.0),
])
def test_format_without_think(text, expected):
    assert score("format", [text], require_think=False) == [expected]


def test_format_custom_tags():
    good = "<reasoning>x</reasoning><final>7</final>"
    assert score("format", [good, "<think>x</think><answer>7</answer>"], think_tag="reasoning",
                 answer_tag="final") == [1.0, 0.0]


def test_format_needs_completions():
    batch = RewardBatch(prompts=["p"], group=torch.zeros(1, dtype=torch.long), images=torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="'format' needs text completions"):
        build_reward("format")(batch)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab <>/thinkanswer\n")), max_size=60))
def test_format_is_binary_on_any_text(text):
    assert score("format", [text])[0] in (0.0, 1.0)
    assert score("format", [text], require_think=False)[0] in (0.0, 1.0)


# ---------------------------------------------------------------- accuracy

def acc(pred, gt, problem_type, **args):
    return score("accuracy", [f"<think>...</think><answer>{pred}</answer>"],
                 [{"problem_type": problem_type, "solution": f"<answer>{gt}</answer>"}], **args)[0]


@pytest.mark.parametrize("pred, gt, expected", [
    ("B", "B", 1.0), ("b", "B", 1.0), (" B. ", "B", 1.0), ("B)", "B", 1.0), ("(B)", "B", 1.0),
    ("B. a red ball", "B", 1.0), ("(B) a red ball", "B", 1.0), ("B: a red ball", "B", 1.0),
    ("C", "B", 0.0), ("A cat", "A", 0.0), ("a red ball", "B", 0.0), ("B", "B. a red ball", 1.0),
])
def test_accuracy_multiple_choice(pred, gt, expected):
    assert acc(pred, gt, "multiple choice") == expected


@pytest.mark.parametrize("text, letter", [("b", "B"), ("(c).", "C"), ("D: x", "D"), ("A cat", "A CAT"),
                                          ("yes.", "YES")])
def test_normalize_choice(text, letter):
    assert normalize_choice(text) == letter


def answers(letters):
    return [f"<think>x</think><answer>{x}</answer>" for x in letters]


def test_answer_diversity_against_entropies():
    truth = ["<answer>A</answer>", "<answer>B</answer>", "<answer>C</answer>", "<answer>D</answer>"]
    assert answer_diversity(answers("DCBA"), truth) == pytest.approx(1.0)
    assert answer_diversity(answers("AAAA"), truth) == 0.0  # one letter for every question
    # A, A, (b) and one without an answer: the entropy of {A: 2/3, B: 1/3} over that of four letters, log 4
    expected = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(4)
    assert answer_diversity(answers(["A", "A", "(b)"]) + ["no tag"], truth) == pytest.approx(expected)
    assert math.isnan(answer_diversity(["no tag"] * 4, truth))
    assert math.isnan(answer_diversity(answers("AB"), ["A", "A"]))  # the truth is one letter: nothing to compare


@given(st.lists(st.sampled_from("ABCD"), min_size=2, max_size=12), st.permutations(range(12)))
@settings(max_examples=50, deadline=None)
def test_answer_diversity_ignores_order(letters, order):
    truth = [f"<answer>{x}</answer>" for x in "ABCDABCDABCD"[:len(letters)]]
    shuffled = [letters[i] for i in order if i < len(letters)]
    assert answer_diversity(answers(letters), truth) == pytest.approx(answer_diversity(answers(shuffled), truth),
                                                                      nan_ok=True)


@pytest.mark.parametrize("pred, gt, expected", [
    ("3", "3", 1.0), ("3.0", "3", 1.0), ("1,000", "1000", 1.0), ("1,000,000.5", "1000000.5", 1.0),
    ("3.004", "3", 1.0),  # rounds to 3.00
    ("3.006", "3", 0.0),  # rounds to 3.01
    ("-2.5", "-2.5", 1.0), ("4", "3", 0.0),
    ("\\frac{1}{2}", "0.5", 1.0),  # math-verify fallback
    ("\\frac{1}{3}", "0.5", 0.0),
    ("three", "3", 0.0),
])
def test_accuracy_numerical(pred, gt, expected):
    assert acc(pred, gt, "numerical") == expected


def test_math_equal_gives_up_on_a_runaway_answer_off_the_main_thread(monkeypatch):
    """sympy holds the GIL on 9^(9^9); the worker process is killed after the timeout, and the next call works."""
    math_equal("1", "1")  # start the worker outside the timed call
    monkeypatch.setattr(text_rules, "MATH_TIMEOUT_S", 1.0)
    verdict, took = [], []

    def compare():
        start = time.perf_counter()
        verdict.append(math_equal("9^{9^{9}}", "3"))
        took.append(time.perf_counter() - start)

    worker = threading.Thread(target=compare)
    worker.start()
    worker.join(timeout=60)
    assert verdict == [False] and took[0] < 10
    assert math_equal("\\frac{1}{2}", "0.5") and not math_equal("\\frac{1}{3}", "0.5")


@pytest.mark.parametrize("text, value", [("1,000", 1000.0), (" 3.0 ", 3.0), ("1e3", 1000.0), ("12,34", None),
                                         ("nan", None), ("inf", None), ("", None), ("3 apples", None)])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_accuracy_ocr_is_one_minus_wer():
    assert acc("the cat sat on", "the cat sat on", "OCR") == 1.0
    assert acc("the cat sat", "the cat sat on", "OCR") == pytest.approx(0.75)  # 1 deletion / 4 words
    assert acc("The cat sat on", "the cat sat on", "OCR") == pytest.approx(0.75)  # case-sensitive
    assert acc("x y z w v", "a", "OCR") == 0.0  # WER 5 is clipped


def test_accuracy_free_form_is_mean_rouge():
    # ROUGE-1 F: P 2/2, R 2/3 -> 0.8; ROUGE-2 F: P 1/1, R 1/2 -> 2/3; ROUGE-L F (LCS 2): 0.8
    assert acc("the cat", "the cat sat", "free-form") == pytest.approx((0.8 + 2 / 3 + 0.8) / 3)
    assert acc("The cat sat.", "the cat sat", "free-form") == pytest.approx(1.0)
    assert acc("dog", "the cat sat", "free-form") == 0.0


@pytest.mark.parametrize("pred, gt, expected", [
    ("8", "10", 0.8), ("12", "10", 0.8), ("10", "10", 1.0), ("25", "10", 0.0), ("-8", "-10", 0.8),
    ("0", "0", 1.0), ("0.1", "0", 0.0), ("about ten", "10", 0.0),
])
def test_accuracy_regression(pred, gt, expected):
    assert acc(pred, gt, "regression") == pytest.approx(expected)


@pytest.mark.parametrize("alias", ["multiple_choice", "Multiple-Choice", "MULTIPLE CHOICE", "mc"])
def test_problem_type_aliases(alias):
    assert canonical_problem_type(alias) == "multiple choice"
    assert acc("B", "B", alias) == 1.0


def test_answer_only_from_last_answer_block():
    meta = [{"problem_type": "multiple choice", "solution": "<answer>B</answer>"}] * 6
    completions = [
        "<think>it is B</think> B",  # no answer block: the ground truth elsewhere in the text pays nothing
        "<answer></answer>",  # blank answer
        "",  # empty completion
        "<answer>A</answer> on second thought <answer>B</answer>",
        "<answer>B</answer> on second thought <answer>A</answer>",
        "B",
    ]
    assert score("accuracy", completions, meta) == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40).filter(lambda t: "<answer>" not in t))
def test_no_answer_block_never_pays(text):
    meta = [{"problem_type": t, "solution": "B"} for t in ("multiple choice", "OCR", "free-form")]
    assert score("accuracy", [text + " B"] * 3, meta) == [0.0, 0.0, 0.0]


def test_ground_truth_sources():
    completions = ["<answer>7</answer>"] * 3
    meta = [{"problem_type": "numerical", "solution": "<answer>7</answer>"},
            {"problem_type": "numerical", "answer": 7},  # EasyR1 column, not a string
            {"answer": "7"}]  # no problem_type: default_type applies
    assert score("accuracy", completions, meta, default_type="numerical") == [1.0, 1.0, 1.0]


def test_accuracy_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown problem_type 'essay' \(sample 1\); valid: multiple choice"):
        score("accuracy", ["<answer>B</answer>"] * 2,
              [{"problem_type": "OCR", "solution": "B"}, {"problem_type": "essay", "solution": "B"}])
    with pytest.raises(ValueError, match="unknown problem_type None"):
        score("accuracy", ["<answer>B</answer>"], [{"solution": "B"}])
    with pytest.raises(ValueError, match="sample 0 has no 'solution' or 'answer'"):
        score("accuracy", ["<answer>B</answer>"], [{"problem_type": "OCR"}])
    with pytest.raises(ValueError, match="empty ground truth"):
        score("accuracy", ["<answer>B</answer>"], [{"problem_type": "OCR", "solution": "<answer> </answer>"}])
    with pytest.raises(ValueError, match="sample 0 has an empty ground truth"):  # not jiwer's complaint
        score("accuracy", ["<answer>B</answer>"], [{"problem_type": "OCR", "solution": "<answer>\\boxed{ }</answer>"}])
    with pytest.raises(ValueError, match="unknown_type must be"):
        build_reward("accuracy", {"unknown_type": "skip"})
    with pytest.raises(ValueError, match="unknown default_type 'essay'"):
        build_reward("accuracy", {"default_type": "essay"})


def test_unknown_type_can_mean_does_not_apply():
    meta = [{"problem_type": "essay", "solution": "B"}, {"problem_type": "multiple choice", "solution": "B"}]
    out = score("accuracy", ["<answer>B</answer>"] * 2, meta, unknown_type="nan")
    assert math.isnan(out[0]) and out[1] == 1.0


# ---------------------------------------------------------------- length

@pytest.mark.parametrize("n, expected", [(0, 0.0), (5, 0.5), (10, 1.0), (15, 1.0), (20, 1.0), (25, 0.5),
                                         (30, 0.0), (45, 0.0)])
def test_length_piecewise_linear(n, expected):
    assert score("length", ["x" * n], max_len=20, min_len=10, slack=10) == [pytest.approx(expected)]


def test_length_units_and_defaults():
    # tokens are whitespace-separated words; slack defaults to max_len
    assert score("length", ["a  b\nc", "a b c d e f"], max_len=4, unit="tokens") == [1.0, 0.5]
    assert score("length", ["", "x"], max_len=4) == [0.0, 1.0]  # empty is 0 even with no lower bound
    for bad in ({"max_len": 5, "min_len": 6}, {"max_len": 5, "unit": "bytes"}, {"max_len": 5, "slack": 0}):
        with pytest.raises(ValueError, match="length: "):
            build_reward("length", bad)


# ---------------------------------------------------------------- temporal IoU

@pytest.mark.parametrize("answer, expected", [
    ("[2, 6]", 1 / 3),  # overlap [4, 6] = 2, union [2, 8] = 6
    ("4-8", 1.0), ("4.0s to 8.0s", 1.0), ("(5, 7)", 0.5),
    ("[0, 3]", 0.0),  # disjoint
    ("[8, 4]", 0.0),  # reversed
    ("around four seconds", 0.0), ("[1, 2, 3]", 0.0),
])
def test_temporal_iou(answer, expected):
    out = score("temporal_iou", [f"<think>t</think><answer>{answer}</answer>"], [{"solution": [4, 8]}])
    assert out == [pytest.approx(expected)]


@pytest.mark.parametrize("answer, expected", [
    ("[3, 3]", 1.0),  # the same point: union 0, the IoU is 1
    ("[5, 5]", 0.0),  # another point: union 0 too, the IoU is 0
    ("[2, 4]", 0.0),  # an interval around the point: intersection 0 over union 2
])
def test_temporal_iou_of_a_point_ground_truth(answer, expected):
    out = score("temporal_iou", [f"<answer>{answer}</answer>"], [{"solution": [3, 3]}])
    assert out == [expected]


def test_temporal_iou_ground_truth_forms_and_missing_answer():
    completions = ["<answer>[4, 8]</answer>", "<answer>[4, 8]</answer>", "[4, 8]"]
    meta = [{"solution": "<answer>[4, 8]</answer>"}, {"solution": "4.0 - 8.0"}, {"solution": [4, 8]}]
    assert score("temporal_iou", completions, meta) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="sample 0 ground truth 'soon' is not an interval"):
        score("temporal_iou", ["<answer>[1, 2]</answer>"], [{"solution": "soon"}])
    ok = {"solution": [1, 2]}
    for bad in (["a", "b"], [None, 2], [[1], 2]):  # a list that is not two numbers: named, not a float() error
        with pytest.raises(ValueError, match=rf"^temporal_iou: sample 1 ground truth {re.escape(repr(bad))} is not"):
            score("temporal_iou", ["<answer>[1, 2]</answer>"] * 2, [ok, {"solution": bad}])


def test_parse_interval_points():
    assert parse_interval("[3, 3]") == (3.0, 3.0)
    assert parse_interval((1, 2.5)) == (1.0, 2.5)
    assert parse_interval("5") is None
    assert parse_interval(["a", "b"]) is None and parse_interval([None, 1]) is None


@pytest.mark.parametrize("text, expected", [
    ("[0, .5]", (0.0, 0.5)), ("[.5, 6]", (0.5, 6.0)),  # leading-dot decimals are one number, not "5"
    ("12.5-17", (12.5, 17.0)), ("0.5 - 2", (0.5, 2.0)), ("12.5s - 17s", (12.5, 17.0)),  # a dash between numbers
    ("between 2 and 4", (2.0, 4.0)),
    ("[3, -5]", None), ("-3 to 5", None), ("3 to -5", None), ("(-1, 4)", None),  # negative, not "3 to 5"
])
def test_parse_interval_reads_signs_and_leading_dot_decimals(text, expected):
    assert parse_interval(text) == expected


# ---------------------------------------------------------------- answer extraction edge cases

@pytest.mark.parametrize("text, inner", [
    ("<answer>A <answer>B</answer>", "B"),  # a reopened tag: the last block is the innermost one
    ("<answer>A</answer> then <answer>x <answer>C</answer>", "C"),
    ("<answer>A</answer> and <answer>B", "A"),  # an unclosed last tag is no block
])
def test_last_tagged_never_holds_an_opening_tag(text, inner):
    assert last_tagged(text) == inner
    start, end = last_tagged_span(text)
    assert text[start:end] == inner


def test_nested_answer_tags_do_not_leak_into_the_scored_text():
    meta = [{"problem_type": "OCR", "solution": "the cat sat"}]
    assert score("accuracy", ["<answer>the dog <answer>the cat sat</answer>"], meta) == [1.0]


@pytest.mark.parametrize("text, letter", [
    ("Option B", "B"), ("option (c)", "C"), ("Answer: B", "B"), ("The answer is (D).", "D"), ("Choice A. cat", "A"),
    ("Option A or B", "OPTION A OR B"), ("Answers vary", "ANSWERS VARY"),  # not one letter: whole text
])
def test_normalize_choice_reads_a_labelled_letter(text, letter):
    assert normalize_choice(text) == letter


@pytest.mark.parametrize("pred, expected", [
    ("\\boxed{B}", 1.0), ("$\\boxed{\\text{B}}$", 1.0), ("\\boxed{C}", 0.0),
    ("\\boxed{A} or \\boxed{B}", 0.0),  # two boxes are not one wrapped answer
])
def test_accuracy_multiple_choice_boxed(pred, expected):
    assert acc(pred, "B", "multiple choice") == expected


@pytest.mark.parametrize("pred, gt, problem_type, expected", [
    ("\\boxed{8}", "10", "regression", 0.8), ("$8$", "10", "regression", 0.8),
    ("\\boxed{3.004}", "3", "numerical", 1.0),  # rounds to 3.00 as the bare number does
    ("\\boxed{\\frac{1}{2}}", "0.5", "numerical", 1.0),  # nested braces
    ("\\boxed{the cat sat}", "the cat sat", "OCR", 1.0),
])
def test_accuracy_unwraps_a_boxed_answer(pred, gt, problem_type, expected):
    assert acc(pred, gt, problem_type) == pytest.approx(expected)



@pytest.mark.parametrize("text, inner", [
    (" $\\boxed{\\frac{1}{2}}$ ", "\\frac{1}{2}"), ("\\( 5 \\)", "5"), ("$$\\text{B}$$", "B"), ("\\boxed {7}", "7"),
    ("$5", "$5"), ("$5$ and $6$", "$5$ and $6$"), ("\\boxed{1} or \\boxed{2}", "\\boxed{1} or \\boxed{2}"),
    ("\\boxed{5", "\\boxed{5"), ("\\boxed{}", ""),
])
def test_unwrap_answer(text, inner):
    assert unwrap_answer(text) == inner


@pytest.mark.parametrize("options", [["A. red ball", "B. blue cube", "C. green cone"],
                                     ["red ball", "blue cube", "green cone"]])  # labelled A, B, C in order
@pytest.mark.parametrize("pred, gt, expected", [
    ("blue cube", "B", 1.0), ("Blue cube.", "B", 1.0), ("red ball", "B", 0.0), ("B", "blue cube", 1.0),
    ("a blue cube", "B", 0.0),  # not an option's text
])
def test_accuracy_multiple_choice_reads_option_text(options, pred, gt, expected):
    out = score("accuracy", [f"<answer>{pred}</answer>"],
                [{"problem_type": "multiple choice", "solution": gt, "options": options}])
    assert out == [expected]


def test_option_texts_that_start_like_labels_out_of_order_are_lettered_in_order():
    """["a.m.", "p.m."]: "p.m." read as option P's empty text, so the answer "p.m." never meant B."""
    meta = [{"problem_type": "multiple choice", "solution": "B", "options": ["a.m.", "p.m."]}]
    assert score("accuracy", ["<answer>p.m.</answer>", "<answer>a.m.</answer>"], meta * 2) == [1.0, 0.0]


def test_a_letter_wins_over_an_option_whose_text_is_a_letter():
    meta = [{"problem_type": "multiple choice", "solution": "A", "options": ["B", "A"]}]
    assert score("accuracy", ["<answer>A</answer>", "<answer>B</answer>"], meta * 2) == [1.0, 0.0]


@pytest.mark.parametrize("text, value", [("\u22122.5", -2.5), ("\u22121,000", -1000.0), ("1_000", None), ("1_0", None)])
def test_parse_number_reads_the_unicode_minus_and_no_underscores(text, value):
    assert parse_number(text) == value


def test_regression_with_a_unicode_minus_ground_truth():
    assert acc("-8", "\u221210", "regression") == pytest.approx(0.8)


def test_a_null_solution_falls_back_to_the_answer_column():
    """A dataset with both columns holds None where a row has only one of them (datasets fills the gaps)."""
    meta = [{"problem_type": "numerical", "solution": None, "answer": "7"}]
    assert score("accuracy", ["<answer>7</answer>"], meta) == [1.0]
    assert score("temporal_iou", ["<answer>[4, 8]</answer>"], [{"solution": None, "answer": [4, 8]}]) == [1.0]


def test_a_custom_answer_tag_still_unwraps_video_r1_ground_truths():
    """Video-R1 data wraps every solution in <answer> tags, whatever tag the policy is asked to write."""
    meta = [{"problem_type": "multiple choice", "solution": "<answer>B</answer>"},
            {"problem_type": "multiple choice", "solution": "<final>C</final>"}]
    assert score("accuracy", ["<final>B</final>", "<final>C</final>"], meta, answer_tag="final") == [1.0, 1.0]
    assert score("temporal_iou", ["<final>[4, 8]</final>"], [{"solution": "<answer>[4, 8]</answer>"}],
                 answer_tag="final") == [1.0]


# ---------------------------------------------------------------- several acceptable ground truths

@pytest.mark.parametrize("problem_type, references, pred, expected", [
    ("free-form", ["the cat sat", "a dog ran"], "a dog ran", 1.0),
    ("OCR", ["the cat sat on", "the cat sat"], "the cat sat", 1.0),
    ("OCR", ["the cat sat on", "x y"], "the cat sat", 0.75),  # the best of 0.75 and 0
    ("numerical", ["2", 3], "3", 1.0),  # a number among the references
    ("numerical", ("2", "3"), "4", 0.0),
    ("regression", ["10", "20"], "18", 0.9),  # max(0.2, 0.9)
    ("multiple choice", ["B", "<answer>C</answer>"], "C", 1.0),  # each reference unwrapped on its own
    ("multiple choice", ["B", "C"], "B", 1.0), ("multiple choice", ["B", "C"], "A", 0.0),
])
def test_accuracy_takes_the_best_of_several_references(problem_type, references, pred, expected):
    for column in ("solution", "answer"):
        out = score("accuracy", [f"<answer>{pred}</answer>"], [{"problem_type": problem_type, column: references}])
        assert out == [pytest.approx(expected)]


@pytest.mark.parametrize("references, message", [
    ([], r"^reward 'accuracy': sample 1 has an empty list of ground truths$"),
    (["B", {"text": "B"}], r"^reward 'accuracy': sample 1 ground truth 1 is a dict, not a string or number$"),
    ([None], r"^reward 'accuracy': sample 1 ground truth 0 is a NoneType, not a string or number$"),
    ([True], r"^reward 'accuracy': sample 1 ground truth 0 is a bool, not a string or number$"),
    ([["B"]], r"^reward 'accuracy': sample 1 ground truth 0 is a list, not a string or number$"),
    (["B", " "], r"^reward 'accuracy': sample 1 has an empty ground truth$"),
])
def test_a_bad_list_of_references_is_one_line_naming_the_sample(references, message):
    meta = [{"problem_type": "OCR", "solution": "B"}, {"problem_type": "OCR", "solution": references}]
    with pytest.raises(ValueError, match=message):
        score("accuracy", ["<answer>B</answer>"] * 2, meta)


# ---------------------------------------------------------------- temporal IoU in a batch of several problem types

def test_temporal_iou_does_not_apply_to_other_problem_types():
    meta = [{"problem_type": "multiple choice", "solution": "<answer>B</answer>"},
            {"solution": [4, 8]},  # no problem type: temporal grounding, as before
            {"problem_type": "temporal grounding", "solution": "<answer>[4, 8]</answer>"},
            {"problem_type": "numerical", "answer": "7"},
            {"problem_type": "Temporal_Grounding", "solution": [4, 6]},
            {"problem_type": "free-form"}]  # another type needs no ground truth here
    out = score("temporal_iou", ["<answer>[4, 8]</answer>"] * 6, meta)
    assert ["nan" if math.isnan(x) else x for x in out] == ["nan", 1.0, 1.0, "nan", 0.5, "nan"]


def test_temporal_iou_still_refuses_a_bad_interval_on_a_temporal_grounding_row():
    meta = [{"problem_type": "OCR", "solution": "soon"}, {"problem_type": "temporal grounding", "solution": "soon"}]
    with pytest.raises(ValueError, match="^temporal_iou: sample 1 ground truth 'soon' is not an interval"):
        score("temporal_iou", ["<answer>[1, 2]</answer>"] * 2, meta)
    with pytest.raises(ValueError, match="sample 0 has no 'solution' or 'answer'"):
        score("temporal_iou", ["<answer>[1, 2]</answer>"], [{"problem_type": "temporal grounding"}])


def test_temporal_iou_unknown_problem_type_raises_or_does_not_apply():
    meta = [{"solution": [1, 2]}, {"problem_type": "spatial grounding", "solution": [1, 2, 3, 4]}]
    with pytest.raises(ValueError, match=r"^temporal_iou: unknown problem_type 'spatial grounding' \(sample 1\)"):
        score("temporal_iou", ["<answer>[1, 2]</answer>"] * 2, meta)
    out = score("temporal_iou", ["<answer>[1, 2]</answer>"] * 2, meta, unknown_type="nan")
    assert out[0] == 1.0 and math.isnan(out[1])
    with pytest.raises(ValueError, match="temporal_iou: unknown_type must be"):
        build_reward("temporal_iou", {"unknown_type": "skip"})


def test_accuracy_does_not_apply_to_temporal_grounding_rows():
    meta = [{"problem_type": "temporal grounding", "solution": [4, 8]}, {"problem_type": "OCR", "solution": "a b"}]
    out = score("accuracy", ["<answer>[4, 8]</answer>", "<answer>a b</answer>"], meta)
    assert math.isnan(out[0]) and out[1] == 1.0


def test_a_batch_without_temporal_grounding_rows_is_expected_by_the_zoo():
    from mmgrpo.config import RewardSpec
    from mmgrpo.rewards import RewardZoo

    zoo = RewardZoo([RewardSpec(name="temporal_iou", args={})], max_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main, _, _ = zoo(text_batch(["<answer>B</answer>"] * 2, [{"problem_type": "multiple choice",
                                                                  "solution": "B"}] * 2))
    assert main.isnan().all() and zoo.nan_counts["temporal_iou"] == 2


@pytest.mark.parametrize("bad", [[0, math.inf], ["1", "nan"], [0.0, float("-inf")], ["0", "inf"]])
def test_an_infinite_ground_truth_interval_is_refused(bad):
    assert parse_interval(bad) is None
    with pytest.raises(ValueError, match="is not an interval"):
        score("temporal_iou", ["<answer>[0, 5]</answer>"], [{"solution": bad}])


def test_a_null_problem_type_takes_the_default_type():
    """A dataset with a problem_type column holds None in the rows that have none: the default applies, as for a
    missing key (a null solution likewise counts as missing)."""
    meta = [{"problem_type": None, "answer": "7"}, {"answer": "7"}]
    assert score("accuracy", ["<answer>7</answer>"] * 2, meta, default_type="numerical") == [1.0, 1.0]


def test_a_regression_ground_truth_that_is_not_a_number_names_the_sample():
    meta = [{"problem_type": "regression", "solution": "10"}, {"problem_type": "regression", "solution": ["10", "ten"]}]
    with pytest.raises(ValueError, match=r"^accuracy: sample 1: regression ground truth 'ten' is not a number$"):
        score("accuracy", ["<answer>10</answer>"] * 2, meta)
