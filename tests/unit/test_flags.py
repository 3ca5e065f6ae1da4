"""A settings model as a command line (``pipeline.process.flags``): what the flags parse
into is the model, a model written as argv parses back into itself, a bad value is a
usage error naming its flag, and every flag has its help."""

from __future__ import annotations

import argparse
import enum
from pathlib import Path
from typing import Annotated, Literal, Self

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.process.flags import NOT_A_FLAG, Flag, FlagError, add_flags, from_flags, to_argv
from pipeline.run.config import RunConfig
from stages.envs.arithmetic import Task


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


class Example(BaseModel):
    """A model with one field of every kind the helper handles."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: Annotated[Literal["a", "b"], Flag(positional=True)]
    """which one"""
    wait_s: Annotated[float, Field(gt=0), Flag("--wait")] = 1.5
    """seconds to wait"""
    count: Annotated[int, Field(ge=0), Flag(group="sizes")] = 3
    """how many"""
    limit: Annotated[int | None, Flag(group="sizes", metavar="N")] = None
    """at most this many (default: no limit)"""
    colour: Colour = Colour.RED
    """what colour"""
    mode: Literal["fast", "slow"] = "fast"
    """how"""
    where: Path | None = None
    """where to write"""
    loud: bool = False
    """say more"""
    owner: Annotated[list[str] | None, Flag(metavar="GROUP")] = None
    """an owner (repeatable)"""
    secret: Annotated[str, NOT_A_FLAG] = "hidden"

    @model_validator(mode="after")
    def _fits(self) -> Self:
        if self.limit is not None and self.limit < self.count:
            raise ValueError(f"limit: {self.limit} is below count {self.count}")
        return self


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser(prog="example")
    add_flags(built, Example)
    return built


def parse(argv: list[str], **given: object) -> Example:
    return from_flags(Example, parser().parse_args(argv), **given)


def test_the_flags_default_to_the_models_defaults() -> None:
    assert parse(["a"]) == Example(name="a")


def test_every_kind_of_field_parses_into_the_model() -> None:
    argv = ["b", "--wait", "0.25", "--count", "0", "--limit", "7", "--colour", "blue", "--mode", "slow"]
    argv += ["--where", "/tmp/x", "--loud", "--owner", "g1", "--owner", "g2"]
    assert parse(argv, secret="given") == Example(
        name="b",
        wait_s=0.25,
        count=0,
        limit=7,
        colour=Colour.BLUE,
        mode="slow",
        where=Path("/tmp/x"),
        loud=True,
        owner=["g1", "g2"],
        secret="given",
    )


@pytest.mark.parametrize(
    "settings",
    [
        Example(name="a"),
        Example(name="b", wait_s=0.1, count=9, limit=10, colour=Colour.BLUE, mode="slow"),
        Example(name="a", where=Path("/x y/z"), loud=True, owner=["g1", "g2"]),
    ],
)
def test_a_model_written_as_argv_parses_back_into_itself(settings: Example) -> None:
    assert parse(to_argv(settings)) == settings


def test_argv_says_only_what_differs_from_the_defaults() -> None:
    assert to_argv(Example(name="a")) == ["a"]
    assert to_argv(Example(name="a", count=5)) == ["a", "--count", "5"]


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["a", "--wait", "0"], "--wait", "greater than 0"),
        (["a", "--count", "x"], "--count", "valid integer"),
        (["a", "--colour", "green"], "--colour", "should be 'red' or 'blue'"),
        (["c"], "name", "should be 'a' or 'b'"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_its_flag(
    argv: list[str], flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flag}" in err and words in err


def test_settings_that_do_not_go_together_name_the_flag() -> None:
    with pytest.raises(FlagError, match=r"^--limit: 2 is below count 3$"):
        parse(["a", "--limit", "2"])


def test_every_flag_has_its_help_with_its_default() -> None:
    text = parser().format_help()
    for words in (
        "seconds to wait (default: 1.5)",
        "what colour (default: red)",
        "at most this many (default: no limit)",
        "say more",
        "sizes:",
        "--limit N",
        "--owner GROUP",
    ):
        assert words in " ".join(text.split())
    assert "--secret" not in text


def test_a_run_config_round_trips_through_its_flags() -> None:
    config = RunConfig(
        model_dir=Path("/models/m"),
        rollouts=12,
        group_size=3,
        top_p=0.9,
        stages="inline",
        agent="sdk",
        train_steps=2,
        max_staleness=1,
        staleness_measure="newest",
        trainer_dtype="bfloat16",
    )
    built = argparse.ArgumentParser()
    add_flags(built, RunConfig)
    assert from_flags(RunConfig, built.parse_args(to_argv(config))) == config


def test_a_bad_run_setting_names_the_runs_flag() -> None:
    built = argparse.ArgumentParser()
    add_flags(built, RunConfig)
    with pytest.raises(FlagError, match=r"^--timeout: must be > 0, got 0.0$"):
        from_flags(RunConfig, built.parse_args(["--timeout", "0"]))


def test_what_a_command_line_cannot_say_is_refused_not_dropped() -> None:
    """A tasks file's tasks are read from the file: the tasks themselves have no flag."""
    config = RunConfig(tasks=(Task("sum", "2 + 3"),), group_size=2, rollouts=2)
    with pytest.raises(ValueError, match=r"^--tasks: .* cannot be written as a command line$"):
        to_argv(config)
