"""A sweep's runs grouped into ensemble programs, for ``experiments/sweep.py
--ensemble=M``: each run's overrides split into a program part and a member
part (:func:`split_runs`), runs with equal program parts put into programs
of at most M members (:func:`assign`), kept in ``ensembles.json`` so that
an assigned run never moves, and each program's ``train.py`` command with
one ``--member`` flag per run (:func:`make_programs`). Why the assignment
stays fixed across reruns is in ``docs/sweeps.md``.
"""

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from lmhead.lab import sweeps
from lmhead.lm import configuration, members

ASSIGNMENT_FILE = "ensembles.json"  # in the sweep directory
PROGRAMS_DIR = "ensembles"  # in the sweep directory: one workdir per program

Overrides = dict[str, Any]
# program name -> {member run name: member overrides}, in the order formed
Assignment = dict[str, dict[str, Overrides]]
Parts = dict[str, tuple[Overrides, Overrides]]  # run name -> (program, member)


def split_runs(
    runs: Sequence[dict], base: str, shared: Overrides, config_file: str
) -> Parts:
    """Each run's overrides as ``(program part, member part)``, by run name
    (:func:`lmhead.lm.members.split_overrides` on the run's config:
    ``get_config(base)`` of ``config_file`` with ``shared`` and the run's
    overrides set).

    Raises:
        ValueError: naming the run, for an override that is not a config key
            or whose value the key's type refuses.

    Examples:
        >>> runs = [{"name": "r", "overrides": {"model.tied": False, "train.seed": 1}}]
        >>> split_runs(runs, "tiny", {}, configuration.CONFIG_FILE)
        {'r': ({'model.tied': False}, {'train.seed': 1})}
    """
    base_config = configuration.load_config(base, config_file)
    valid = configuration.flatten(base_config)
    parts = {}
    for run in runs:
        config = base_config.copy_and_resolve_references()
        try:
            for key, value in {**shared, **run["overrides"]}.items():
                configuration.check_config_keys([key], valid)
                section, name = key.split(".")
                config[section][name] = value
        except (TypeError, ValueError) as e:
            raise ValueError(f"run {run['name']}: {e}") from e
        parts[run["name"]] = members.split_overrides(run["overrides"], config)
    return parts


def _part_key(overrides: Overrides) -> str:
    return json.dumps(overrides, sort_keys=True, default=repr)


def _as_stored(overrides: Overrides) -> Overrides:
    """``overrides`` as ``ensembles.json`` gives them back."""
    return json.loads(json.dumps(overrides))


def assign(
    names: Sequence[str], parts: Parts, assignment: Assignment, size: int
) -> Assignment:
    """``assignment`` (the programs formed before, kept as they are) with
    the runs ``names`` that are in none of its programs grouped into new
    programs: runs with equal program parts (``parts``, :func:`split_runs`)
    together, at most ``size`` each, in the order of ``names``.

    Examples:
        >>> parts = {"a": ({"model.tied": True}, {"train.seed": 0}),
        ...          "b": ({"model.tied": False}, {"train.seed": 0}),
        ...          "c": ({"model.tied": True}, {"train.seed": 1})}
        >>> first = assign(["a", "b"], parts, {}, size=2)
        >>> first  # doctest: +NORMALIZE_WHITESPACE
        {'tied=True,ensemble=0': {'a': {'train.seed': 0}},
         'tied=False,ensemble=0': {'b': {'train.seed': 0}}}
        >>> list(assign(["a", "b", "c"], parts, first, size=2))
        ['tied=True,ensemble=0', 'tied=False,ensemble=0', 'tied=True,ensemble=1']
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an integer >= 1; got {size!r}.")
    assigned = {name for program in assignment.values() for name in program}
    groups: dict[str, list[str]] = {}
    for name in names:
        if name not in assigned:
            groups.setdefault(_part_key(parts[name][0]), []).append(name)
    result = dict(assignment)
    for group in groups.values():
        for start in range(0, len(group), size):
            chunk = group[start : start + size]
            name = _program_name(parts[chunk[0]][0], result)
            result[name] = {run: _as_stored(parts[run][1]) for run in chunk}
    return result


def _program_name(program_part: Overrides, taken: Assignment) -> str:
    count = 0
    while True:
        name = sweeps.run_names([{**program_part, "ensemble": count}])[0]
        if name not in taken:
            return name
        count += 1


def read_assignment(sweep_dir: str) -> Assignment:
    """``ensembles.json`` of ``sweep_dir``, or ``{}`` before the first program.

    Examples:
        >>> import tempfile
        >>> sweep_dir = tempfile.mkdtemp()
        >>> read_assignment(sweep_dir)
        {}
        >>> write_assignment(sweep_dir, {"ensemble=0": {"seed=0": {"train.seed": 0}}})
        >>> read_assignment(sweep_dir)
        {'ensemble=0': {'seed=0': {'train.seed': 0}}}
    """
    path = os.path.join(sweep_dir, ASSIGNMENT_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def reserve(sweep_dir: str, programs: dict[str, Sequence[str]]) -> None:
    """Records in ``ensembles.json`` programs that trained elsewhere (their
    runs restored as finished), with no member overrides, so that no new
    program takes their names; a program already recorded, and a run
    already in one, are left as they are.

    Examples:
        >>> import tempfile
        >>> sweep_dir = tempfile.mkdtemp()
        >>> write_assignment(sweep_dir, {"p=0": {"a": {"train.seed": 0}}})
        >>> reserve(sweep_dir, {"p=0": ["b"], "q=0": ["a", "c"]})
        >>> read_assignment(sweep_dir)
        {'p=0': {'a': {'train.seed': 0}}, 'q=0': {'c': {}}}
    """
    assignment = read_assignment(sweep_dir)
    assigned = {run for program in assignment.values() for run in program}
    added = {
        name: {run: {} for run in runs if run not in assigned}
        for name, runs in programs.items()
        if name not in assignment
    }
    added = {name: runs for name, runs in added.items() if runs}
    if added:
        write_assignment(sweep_dir, {**assignment, **added})


def write_assignment(sweep_dir: str, assignment: Assignment) -> None:
    """Writes ``ensembles.json`` whole or not at all (a new file, renamed)."""
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, ASSIGNMENT_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(assignment, f, indent=2)
    os.replace(path + ".tmp", path)


def make_programs(
    todo: Sequence[dict],
    parts: Parts,
    assignment: Assignment,
    sweep_dir: str,
    train_command: Callable[[str, Overrides], list[str]],
) -> list[dict]:
    """The programs of ``assignment`` (:func:`assign`) that hold a run of
    ``todo`` (the planned unfinished runs, whose ``parts`` are
    :func:`split_runs`'), each a dict: ``name``, ``workdir``, ``overrides``
    (the program part), ``command`` (``train_command(workdir, program
    part)`` and a ``--member`` flag per member) and ``members`` (each
    member's ``name`` and ``workdir`` under ``sweep_dir``). A program keeps
    every member it was formed with, finished or no longer planned.

    Raises:
        ValueError: a planned run whose overrides no longer fit its program
            (another program part than its fellow members', or other member
            overrides than those it was assigned with).

    Examples:
        >>> parts = {"a": ({"model.tied": True}, {"train.seed": 0})}
        >>> assignment = {"tied=True,ensemble=0": {"a": {"train.seed": 0},
        ...                                        "b": {"train.seed": 1}}}
        >>> [program] = make_programs([{"name": "a"}], parts, assignment, "s",
        ...     lambda workdir, part: ["train.py", f"--workdir={workdir}"])
        >>> program["command"]  # doctest: +NORMALIZE_WHITESPACE
        ['train.py', '--workdir=s/ensembles/tied=True,ensemble=0',
         '--member={"workdir": "s/a", "train.seed": 0}',
         '--member={"workdir": "s/b", "train.seed": 1}']
    """
    planned = {run["name"] for run in todo}
    programs = []
    for name, member_parts in assignment.items():
        here = [run for run in member_parts if run in planned]
        if here:
            _check_fits(name, here, parts, member_parts)
            program_part = parts[here[0]][0]
            programs.append(
                _program(name, member_parts, program_part, sweep_dir, train_command)
            )
    return programs


def _check_fits(
    name: str, here: Sequence[str], parts: Parts, member_parts: dict[str, Overrides]
) -> None:
    """Refuses a run of program ``name`` whose overrides changed since it
    was assigned: the program's checkpoint fits its members as they were."""
    program_key = _part_key(parts[here[0]][0])
    for run in here:
        program_part, member_part = parts[run]
        if (
            _part_key(program_part) != program_key
            or _as_stored(member_part) != member_parts[run]
        ):
            raise ValueError(
                f"run {run} was assigned to program {name} with member "
                f"overrides {member_parts[run]} ({ASSIGNMENT_FILE}); the sweep "
                f"now gives it {member_part} and the program part "
                f"{program_part}. Remove {name} from {ASSIGNMENT_FILE} and its "
                "directory to group its runs again."
            )


def _program(
    name: str,
    member_parts: dict[str, Overrides],
    program_part: Overrides,
    sweep_dir: str,
    train_command: Callable[[str, Overrides], list[str]],
) -> dict:
    workdir = os.path.join(sweep_dir, PROGRAMS_DIR, name)
    program_members = members.make_members(
        [
            {members.WORKDIR_KEY: os.path.join(sweep_dir, run), **overrides}
            for run, overrides in member_parts.items()
        ],
        workdir,
    )
    return dict(
        name=name,
        workdir=workdir,
        overrides=program_part,
        command=[
            *train_command(workdir, program_part),
            *(f"--member={member.to_json()}" for member in program_members),
        ],
        members=[
            dict(name=run, workdir=member.workdir)
            for run, member in zip(member_parts, program_members)
        ],
    )


def group(
    todo: Sequence[dict],
    parts: Parts,
    sweep_dir: str,
    size: int,
    train_command: Callable[[str, Overrides], list[str]],
) -> list[dict]:
    """The processes that run the planned unfinished runs ``todo``, in plan
    order: programs (:func:`make_programs`) and the runs that stay single
    (those with a ``checkpoints/`` folder of their own and no program).
    Runs in no program yet are assigned to new ones of at most ``size``
    (:func:`assign`), and ``ensembles.json`` is written when that changes it.
    """
    before = read_assignment(sweep_dir)
    assigned = {name for program in before.values() for name in program}
    single = [
        run
        for run in todo
        if run["name"] not in assigned
        and os.path.isdir(os.path.join(run["workdir"], "checkpoints"))
    ]
    singles = {run["name"] for run in single}
    assignment = assign(
        [run["name"] for run in todo if run["name"] not in singles],
        parts,
        before,
        size,
    )
    if assignment != before:
        write_assignment(sweep_dir, assignment)
    programs = make_programs(todo, parts, assignment, sweep_dir, train_command)
    position = {run["name"]: index for index, run in enumerate(todo)}

    def first_planned(job: dict) -> int:
        names = [member["name"] for member in job.get("members", [job])]
        return min(position[name] for name in names if name in position)

    return sorted(single + programs, key=first_planned)
