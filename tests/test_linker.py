"""StateLinker: every row of the state-semantics table, in each policy."""

from __future__ import annotations

import copy

import models
import pytest
import torch
from fingerprint import fingerprint

import epass
from epass import StateConflictError, StateLinker, _program
from epass.errors import ArgumentTypeError
from epass.linker import Journal


def _derived(ep, state_dict=None, constants=None):
    """A new program object over the same graph with the given dicts (default: copies)."""
    out = _program.shallow_clone(ep)
    _program.set_state(
        out,
        dict(ep.state_dict) if state_dict is None else state_dict,
        dict(ep.constants) if constants is None else constants,
    )
    return out


@pytest.fixture
def mixed():
    _, ep, _ = models.export("mixed")
    return ep


POLICIES = ["share", "strict", "in_place"]


@pytest.mark.parametrize("policy", POLICIES)
def test_same_objects_keep_both_dicts(mixed, policy):
    before = fingerprint(mixed)
    result = StateLinker(policy=policy).link(mixed, _derived(mixed))
    assert result.program.state_dict is mixed.state_dict
    assert result.program.constants is mixed.constants
    assert result.report.shared
    assert set(result.report.state_dict.unchanged) == set(mixed.state_dict)
    assert fingerprint(mixed) == before


@pytest.mark.parametrize("policy", POLICIES)
def test_new_objects_over_same_memory_are_relinked(mixed, policy):
    sd = {
        k: torch.nn.Parameter(v.detach(), v.requires_grad)
        if isinstance(v, torch.nn.Parameter)
        else v.view(v.shape)
        for k, v in mixed.state_dict.items()
    }
    assert all(sd[k] is not v for k, v in mixed.state_dict.items())
    result = StateLinker(policy=policy).link(mixed, _derived(mixed, state_dict=sd))
    out = result.program
    assert out.state_dict is mixed.state_dict
    assert all(out.state_dict[k] is v for k, v in mixed.state_dict.items())
    assert set(result.report.state_dict.relinked) == set(mixed.state_dict)


@pytest.mark.parametrize(
    "alter",
    [
        lambda t: t.detach().clone(),  # other memory
        lambda t: t.detach().to(torch.float64),  # other dtype
        lambda t: t.detach().flatten()[1:],  # other offset and shape
        lambda t: t.detach().t() if t.dim() == 2 else t.detach().unsqueeze(0),  # strides/shape
    ],
    ids=["clone", "dtype", "offset", "strides"],
)
def test_anything_but_the_same_view_counts_as_changed(mixed, alter):
    key = "embed.weight"
    sd = dict(mixed.state_dict)
    sd[key] = alter(sd[key])
    result = StateLinker().link(mixed, _derived(mixed, state_dict=sd))
    assert result.report.state_dict.changed == (key,)


def test_parameterness_is_part_of_identity(mixed):
    sd = dict(mixed.state_dict)
    sd["embed.weight"] = sd["embed.weight"].detach()  # same memory, no longer a Parameter
    report = StateLinker().link(mixed, _derived(mixed, state_dict=sd)).report
    assert report.state_dict.changed == ("embed.weight",)


@pytest.mark.parametrize("policy", POLICIES)
def test_added_key_gives_the_output_its_own_dict_and_never_enters_the_store(mixed, policy):
    keys = list(mixed.constants)
    consts = dict(mixed.constants)
    new = torch.ones(3)
    consts["folded"] = new
    result = StateLinker(policy=policy).link(mixed, _derived(mixed, constants=consts))
    out = result.program.constants
    assert list(mixed.constants) == keys
    assert out is not mixed.constants and out["folded"] is new
    assert all(out[k] is mixed.constants[k] for k in keys)
    assert result.program.state_dict is mixed.state_dict
    assert result.report.constants.added == ("folded",)
    assert result.report.owners == {"state_dict": "user", "constants": "own"}
    assert not result.report.shared and result.report.state_dict.shared


def test_added_key_next_to_a_relinked_value_holds_the_stores_object(mixed):
    consts = {k: v.view(v.shape) for k, v in mixed.constants.items()}  # new objects
    consts["folded"] = torch.ones(3)
    result = StateLinker().link(mixed, _derived(mixed, constants=consts))
    assert set(result.report.constants.relinked) == set(mixed.constants)
    assert all(result.program.constants[k] is v for k, v in mixed.constants.items())


def test_owner_is_reported_against_the_user_program_given(mixed):
    consts = dict(mixed.constants)
    consts["folded"] = torch.ones(3)
    first = StateLinker().link(mixed, _derived(mixed, constants=consts)).program
    second = StateLinker().link(first, _derived(first), user=mixed).report
    assert second.shared and second.owners == {"state_dict": "user", "constants": "own"}
    assert StateLinker().link(first, _derived(first)).report.owners["constants"] == "user"


@pytest.mark.parametrize("policy", ["share", "strict"])
def test_removed_key_stays_in_the_store(mixed, policy):
    sd = dict(mixed.state_dict)
    dropped = sd.pop("scale")
    result = StateLinker(policy=policy).link(mixed, _derived(mixed, state_dict=sd))
    assert result.program.state_dict is mixed.state_dict
    assert mixed.state_dict["scale"] is dropped
    assert result.report.state_dict.removed == ("scale",)
    assert result.report.removed == ("state_dict:scale",)


def test_removed_key_is_deleted_in_place(mixed):
    sd = dict(mixed.state_dict)
    sd.pop("scale")
    result = StateLinker(policy="in_place").link(mixed, _derived(mixed, state_dict=sd))
    assert result.program.state_dict is mixed.state_dict
    assert "scale" not in mixed.state_dict
    assert result.report.state_dict.removed == ("scale",)


def test_changed_value_diverges_under_share(mixed):
    before = fingerprint(mixed)
    sd = dict(mixed.state_dict)
    new = sd["scale"] * 3
    sd["scale"] = new
    sd["extra"] = torch.zeros(1)
    result = StateLinker().link(mixed, _derived(mixed, state_dict=sd))
    out = result.program
    assert out.state_dict is not mixed.state_dict
    assert out.state_dict["scale"] is new
    assert all(out.state_dict[k] is v for k, v in mixed.state_dict.items() if k != "scale")
    assert out.constants is mixed.constants
    assert result.report.state_dict.changed == ("scale",)
    assert not result.report.state_dict.shared and result.report.constants.shared
    assert not result.report.shared
    assert fingerprint(mixed) == before  # the store is untouched, added keys included


def test_changed_value_raises_under_strict_and_changes_nothing(mixed):
    before = fingerprint(mixed)
    sd = dict(mixed.state_dict)
    sd["scale"] = sd["scale"] * 3
    consts = dict(mixed.constants)
    consts["folded"] = torch.ones(1)
    with pytest.raises(StateConflictError) as info:
        StateLinker(policy="strict").link(
            mixed, _derived(mixed, state_dict=sd, constants=consts), pass_name="scaler"
        )
    assert info.value.keys == ("state_dict:scale",)
    assert "scaler" in str(info.value) and "scale" in str(info.value)
    assert fingerprint(mixed) == before


def test_changed_value_overwrites_store_in_place(mixed):
    sd = dict(mixed.state_dict)
    new = sd["scale"] * 3
    sd["scale"] = new
    result = StateLinker(policy="in_place").link(mixed, _derived(mixed, state_dict=sd))
    assert result.program.state_dict is mixed.state_dict
    assert mixed.state_dict["scale"] is new
    assert result.report.state_dict.changed == ("scale",)


def test_value_comparison_is_opt_in(mixed):
    copied = copy.deepcopy(mixed)
    plain = StateLinker().link(mixed, copy.deepcopy(mixed)).report
    assert set(plain.state_dict.changed) == set(mixed.state_dict)
    result = StateLinker(compare_values=True).link(mixed, copied)
    assert result.program.state_dict is mixed.state_dict
    assert result.program.constants is mixed.constants
    assert set(result.report.state_dict.relinked_by_value) == set(mixed.state_dict)
    assert all(result.program.state_dict[k] is v for k, v in mixed.state_dict.items())


def test_value_comparison_still_sees_real_changes(mixed):
    copied = copy.deepcopy(mixed)
    copied.state_dict["scale"].add_(1)
    report = StateLinker(compare_values=True).link(mixed, copied).report
    assert report.state_dict.changed == ("scale",)


def test_empty_constants_trap_is_repaired():
    _, ep, _ = models.export("no_constants")
    assert ep.constants == {}
    torch_out = ep.run_decompositions()
    assert torch_out.constants is not ep.constants  # torch's `constants or {}`
    assert torch_out.state_dict is not ep.state_dict  # pytorch#114628
    out = StateLinker().link(ep, torch_out).program
    assert out.constants is ep.constants
    assert out.state_dict is ep.state_dict


def test_linking_a_program_to_itself_is_a_no_op(mixed):
    result = StateLinker().link(mixed, mixed)
    assert result.program is mixed
    assert result.report.shared


def test_journal_rollback_restores_the_store(mixed):
    before = fingerprint(mixed)
    journal = Journal()
    sd = dict(mixed.state_dict)
    new_scale = sd["scale"] + 1
    sd["scale"] = new_scale
    sd.pop("embed.weight")
    consts = dict(mixed.constants)
    consts["folded"] = torch.ones(1)
    StateLinker(policy="in_place").link(
        mixed, _derived(mixed, state_dict=sd, constants=consts), journal=journal
    )
    assert mixed.state_dict["scale"] is new_scale
    journal.rollback()
    assert fingerprint(mixed) == before  # values, identities and key order


def test_policy_is_validated():
    with pytest.raises(ValueError, match="policy"):
        StateLinker(policy="shared")  # type: ignore[arg-type]


def test_report_as_dict_has_stable_keys(mixed):
    report = StateLinker().link(mixed, _derived(mixed)).report
    data = report.as_dict()
    assert set(data) == {"policy", "shared", "owners", "state_dict", "constants"}
    assert data["owners"] == {"state_dict": "user", "constants": "user"}
    assert set(data["state_dict"]) == {
        "unchanged",
        "relinked",
        "relinked_by_value",
        "added",
        "removed",
        "changed",
        "shared",
        "owner",
    }


def test_prune_keeps_only_referenced_entries(mixed):
    out = _derived(mixed)
    out.constants["orphan"] = torch.zeros(1)
    out.state_dict["stale"] = torch.zeros(1)
    lean = epass.prune(out)
    assert "orphan" not in lean.constants and "stale" not in lean.state_dict
    assert lean.state_dict is not out.state_dict
    assert all(lean.state_dict[k] is out.state_dict[k] for k in lean.state_dict)
    assert "orphan" in out.constants  # the input keeps its dicts
    lean.validate()
    assert not epass.verification.state_problems(lean)


def test_prune_compact_copies_views_of_dropped_entries():
    from epass.passes import ConstantFold, Decompose

    _, ep, args = models.export("mlp")
    out = epass.PassManager([Decompose(), ConstantFold(fold_views=True)]).run(ep)
    folded = {k: v for k, v in out.constants.items() if k.startswith("folded")}
    assert folded and all(not v.is_contiguous() for v in folded.values())  # weight views
    lean = epass.prune(out, compact=True)
    assert all(lean.constants[k].is_contiguous() for k in folded)
    assert all(lean.constants[k].data_ptr() != v.data_ptr() for k, v in folded.items())
    # Entries that own their memory are kept as they are.
    assert all(lean.state_dict[k] is v for k, v in lean.state_dict.items())
    assert all(lean.state_dict[k] is out.state_dict[k] for k in lean.state_dict)
    torch.testing.assert_close(lean.module()(*args), out.module()(*args))
    assert epass.prune(out).constants == {k: out.constants[k] for k in lean.constants}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ep: epass.prune("x"), "prune takes an ExportedProgram, got str"),
        (lambda ep: StateLinker().link("a", "b"), "original must be an ExportedProgram, got str"),
        (lambda ep: StateLinker().link(ep, None), "new must be an ExportedProgram, got NoneType"),
        (lambda ep: StateLinker().link(None, ep), "original must be an ExportedProgram"),
    ],
    ids=["prune", "link-strings", "link-none-new", "link-none-original"],
)
def test_non_programs_are_a_type_error_naming_the_expected_type(mixed, call, message):
    before = fingerprint(mixed)
    with pytest.raises(ArgumentTypeError, match=message) as info:
        call(mixed)
    assert isinstance(info.value, TypeError) and isinstance(info.value, epass.EpassError)
    assert fingerprint(mixed) == before


@pytest.mark.parametrize(
    ("policy", "removed", "changed", "added", "text"),
    [
        ("share", 2, 0, 0, "user's dicts; 2 entries no longer used by the output; "
         "your dicts are untouched"),
        ("share", 1, 0, 8, "user's state_dict, own constants; 8 entries added, "
         "1 no longer used by the output; your dicts are untouched"),
        ("share", 0, 1, 0, "own state_dict, user's constants; 1 entry changed in its own "
         "dict; your dicts are untouched"),
        ("in_place", 2, 1, 0, "user's dicts; 2 entries deleted from your dicts, "
         "1 overwritten in your dicts"),
        ("share", 0, 0, 0, "user's dicts"),
    ],
)  # fmt: skip
def test_the_state_words_cannot_be_misread(
    policy: str, removed: int, changed: int, added: int, text: str
) -> None:
    """ "2 removed" read as if the user's dict had lost two entries."""
    from epass.linker import DictReport, LinkReport

    sd = DictReport(
        removed=tuple(f"r{i}" for i in range(removed)),
        changed=tuple(f"c{i}" for i in range(changed)),
        shared=not changed or policy == "in_place",
        owner="own" if changed and policy != "in_place" else "user",
    )
    consts = DictReport(
        added=tuple(f"a{i}" for i in range(added)),
        shared=not added,
        owner="own" if added else "user",
    )
    assert LinkReport(policy, sd, consts).summary() == text
