"""An ensemble's members: which config keys may differ between them, and
each member's own config.

Runs that differ only in values that keep every array's shape train as one
program (:func:`lmhead.lm.train.train_program`). A member is a workdir and overrides of
:data:`MEMBER_KEYS` on the program's config. Any other key is one value for
the whole program, and a member that sets one is refused with the reason
(:data:`SHARED_REASONS`). :func:`make_members` checks a list of members;
:func:`member_configs` gives each one's config, checked as a run's config is,
with errors that name the member; :func:`split_overrides` divides a sweep
run's overrides into the program's part and the member's part. What a
member's workdir says of it: finished (:func:`finished_summaries`), failed
(:func:`failed_members`), and an ensemble's own workdir its members
(:func:`check_same_members`).

The tokenizer is the program's, trained once on the shortest prefix that
covers every member's text (docs/training.md, "Ensembles").
"""

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import ml_collections

from lmhead.lm import configuration, monitoring

# The keys a member may set: none changes an array's shape, so every member
# runs the same compiled step. The traced ones enter the step as one value per
# member (those that differ); the others act on the host: the seed (the
# initial parameters, the batches and the dropout keys), the text trained on,
# and the patience of early stopping.
TRACED_KEYS = (
    "optim.lr",
    "optim.min_lr",
    "optim.weight_decay",
    "optim.warmup_steps",
    "optim.table_lr_multiplier",
    "loss.label_smoothing",
    "loss.z_loss",
)
MEMBER_KEYS = (
    "train.seed",
    *TRACED_KEYS,
    "data.train_fraction",
    "data.train_offset",
    "train.patience",
)

# Why a key is one value for the whole program, by key or by section (the
# first match wins).
SHARED_REASONS = (
    ("model.tied", "decides whether the head owns a [V, D] table"),
    ("model.", "sets the model's shapes or structure, which the members share"),
    (
        "data.block_size",
        "sets the batches' shape and the position table's ([block_size, D])",
    ),
    (
        "data.",
        "sets the text or the tokenizer, so the vocabulary and the tables' "
        "shapes (the members share one tokenizer)",
    ),
    ("train.batch_size", "sets the batches' shape"),
    ("train.microbatches", "sets the shape of the accumulated step"),
    (
        "train.steps",
        "sets how many steps the program runs and the length of every "
        "member's cosine schedule",
    ),
    ("mesh.", "sets the devices of the whole program"),
    ("loss.", "sets the loss's code path, which the members share"),
    ("", "is one value for the whole program"),
)
# What a finished run leaves in its workdir; a workdir with one is not trained again.
SUMMARY_FILE = "summary.json"
# In a member's workdir: the step at which a non-finite loss, gradient norm
# or state stopped it (``train.stop_on_nonfinite``).
FAILED_FILE = "failed.json"
# In an ensemble's workdir: its members, as they were given.
ENSEMBLE_FILE = "ensemble.json"
# In a member's spec, the key of its workdir (every other key is a config key).
WORKDIR_KEY = "workdir"
# A member without a workdir gets <program workdir>/MEMBERS_DIR/<index>.
MEMBERS_DIR = "members"


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of an ensemble: its workdir and its :data:`MEMBER_KEYS` overrides."""

    workdir: str
    overrides: dict[str, Any]

    def to_json(self) -> str:
        """The ``--member`` flag's value: ``{"workdir": ..., KEY: VALUE, ...}``.

        Examples:
            >>> Member("runs/s/seed=1", {"train.seed": 1}).to_json()
            '{"workdir": "runs/s/seed=1", "train.seed": 1}'
        """
        return json.dumps({WORKDIR_KEY: self.workdir, **self.overrides})


def shared_reason(key: str) -> str:
    """Why ``key`` cannot differ between members.

    Examples:
        >>> shared_reason("model.d_model")
        "sets the model's shapes or structure, which the members share"
    """
    return next(reason for prefix, reason in SHARED_REASONS if key.startswith(prefix))


def parse_member(text: str, index: int) -> dict[str, Any]:
    """A ``--member`` flag's JSON object, checked to be one.

    Raises:
        ValueError: naming the member, when ``text`` is not a JSON object.

    Examples:
        >>> parse_member('{"train.seed": 1}', 0)
        {'train.seed': 1}
    """
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"member {index}: {text!r} is not JSON ({e}).") from e
    if not isinstance(spec, dict):
        raise ValueError(
            f'member {index}: {text!r} must be a JSON object, e.g. {{"train.seed": 1}}.'
        )
    return spec


def make_members(specs: Sequence[dict[str, Any]], workdir: str) -> list[Member]:
    """Members from specs ``{"workdir": DIR, KEY: VALUE, ...}`` (workdir optional).

    Args:
        specs: one dict per member; keys among :data:`MEMBER_KEYS` and
            ``"workdir"``.
        workdir: the program's workdir; a member without one gets
            ``workdir/members/<index>``.

    Raises:
        ValueError: no members; a key that is not a config key, or one that
            may not differ between members (with the reason); two members
            with the same overrides or the same workdir, or a member workdir
            that is the program's.

    Examples:
        >>> [m.workdir for m in make_members([{"train.seed": 0}, {"train.seed": 1}], "p")]
        ['p/members/0', 'p/members/1']
        >>> make_members([{"model.d_model": 64}], "p")
        Traceback (most recent call last):
        ...
        ValueError: member 0 sets model.d_model, which cannot differ between members: it sets the model's shapes or structure, which the members share. Members may set: train.seed, optim.lr, optim.min_lr, optim.weight_decay, optim.warmup_steps, optim.table_lr_multiplier, loss.label_smoothing, loss.z_loss, data.train_fraction, data.train_offset, train.patience.
    """
    if not specs:
        raise ValueError("An ensemble needs at least one member; got none.")
    members = []
    for index, spec in enumerate(specs):
        overrides = {k: v for k, v in spec.items() if k != WORKDIR_KEY}
        configuration.check_config_keys(overrides, configuration.default_types())
        for key in overrides:
            if key not in MEMBER_KEYS:
                raise ValueError(
                    f"member {index} sets {key}, which cannot differ between "
                    f"members: it {shared_reason(key)}. Members may set: "
                    f"{', '.join(MEMBER_KEYS)}."
                )
        member_dir = spec.get(WORKDIR_KEY) or os.path.join(
            workdir, MEMBERS_DIR, str(index)
        )
        members.append(Member(member_dir, overrides))
    _check_distinct(members, workdir)
    return members


def _check_distinct(members: Sequence[Member], workdir: str) -> None:
    seen_overrides, seen_dirs = {}, {}
    for index, member in enumerate(members):
        key = json.dumps(member.overrides, sort_keys=True)
        if key in seen_overrides:
            raise ValueError(
                f"members {seen_overrides[key]} and {index} have the same "
                f"overrides {member.overrides}: the same run twice."
            )
        path = os.path.normpath(os.path.abspath(member.workdir))
        if path == os.path.normpath(os.path.abspath(workdir)):
            raise ValueError(
                f"member {index}'s workdir {member.workdir!r} is the "
                "program's; give each member a directory of its own."
            )
        if path in seen_dirs:
            raise ValueError(
                f"members {seen_dirs[path]} and {index} have the same workdir "
                f"{member.workdir!r}."
            )
        seen_overrides[key], seen_dirs[path] = index, index


def member_configs(
    config: ml_collections.ConfigDict, members: Sequence[Member]
) -> list[ml_collections.ConfigDict]:
    """Each member's config: ``config`` with its overrides, and the shared
    tokenizer's ``data.tokenizer_fraction`` when the fractions differ (see
    the module docstring); each one checked by ``validate_config``.

    Raises:
        ValueError, TypeError: naming the member and the key, for a value
            of the wrong type or out of its range (a negative learning rate).

    Examples:
        >>> base = configuration.load_config("tiny")
        >>> [c.optim.lr for c in member_configs(base, [
        ...     Member("a", {"optim.lr": 1e-3}), Member("b", {"optim.lr": 2e-3})])]
        [0.001, 0.002]
    """
    configs = []
    for index, member in enumerate(members):
        member_config = config.copy_and_resolve_references()
        try:
            for key, value in member.overrides.items():
                section, name = key.split(".")
                member_config[section][name] = value
            configuration.validate_config(member_config)
        except (TypeError, ValueError) as e:
            raise type(e)(f"member {index} ({member.workdir}): {e}") from e
        configs.append(member_config)
    ranges = {(c.data.get("train_offset", 0.0), c.data.train_fraction) for c in configs}
    shares_bpe = (
        config.data.tokenizer == "bpe" and config.data.tokenizer_fraction is None
    )
    if len(ranges) > 1 and shares_bpe:
        covering = min(1.0, max(offset + fraction for offset, fraction in ranges))
        for member_config in configs:
            member_config.data.tokenizer_fraction = covering
    for member_config in configs:
        member_config.lock()
    return configs


def split_overrides(
    overrides: dict[str, Any], config: ml_collections.ConfigDict
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's overrides as ``(program part, member part)``, for grouping a
    sweep's runs into ensembles: runs with equal program parts can be members
    of one program, and each then equals its run without ensembles.

    The member part holds the :data:`MEMBER_KEYS`, except
    ``data.train_fraction`` and ``data.train_offset`` where the run's
    byte-level BPE tokenizer is trained on its own part of the text
    (``data.tokenizer_fraction`` unset): grouping it with other parts would
    change its tokenizer.
    ``config`` is the run's config with all its overrides applied.

    Examples:
        >>> config = configuration.load_config("tiny")
        >>> split_overrides({"model.tied": False, "train.seed": 2}, config)
        ({'model.tied': False}, {'train.seed': 2})
    """
    tokenizer_is_own = (
        config.data.tokenizer == "bpe" and config.data.tokenizer_fraction is None
    )
    program, member = {}, {}
    for key, value in overrides.items():
        is_member_key = key in MEMBER_KEYS and not (
            key in ("data.train_fraction", "data.train_offset") and tokenizer_is_own
        )
        (member if is_member_key else program)[key] = value
    return program, member


def finished_summaries(members: Sequence[Member]) -> dict[str, dict]:
    """The summaries of the members that have finished (``summary.json``),
    by workdir: a finished member is not trained again."""
    summaries = {}
    for member in members:
        path = os.path.join(member.workdir, SUMMARY_FILE)
        if os.path.exists(path):
            with open(path) as f:
                summaries[member.workdir] = json.load(f)
            monitoring.log(f"{member.workdir} has finished; it is not trained again.")
    return summaries


def failed_members(members: Sequence[Member]) -> set[str]:
    """The workdirs of the members that a non-finite value stopped."""
    failed = set()
    for member in members:
        if os.path.exists(os.path.join(member.workdir, FAILED_FILE)):
            failed.add(member.workdir)
            monitoring.log(
                f"{member.workdir} was stopped by a non-finite value "
                f"({FAILED_FILE}); it is not trained again."
            )
    return failed


def members_record(members: Sequence[Member]) -> list[dict]:
    """The members as ``ensemble.json`` lists them."""
    return [dict(workdir=m.workdir, overrides=m.overrides) for m in members]


def check_same_members(workdir: str, members: Sequence[Member]) -> None:
    """Refuses to resume an ensemble's checkpoints with other members than
    its ``ensemble.json`` lists."""
    path = os.path.join(workdir, ENSEMBLE_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)["members"]
    if json.loads(json.dumps(members_record(members))) != saved:
        raise ValueError(
            f"{workdir} holds checkpoints of an ensemble of other members "
            f"({path} lists them), so it cannot resume with these; use a "
            "fresh --workdir or the same members."
        )
