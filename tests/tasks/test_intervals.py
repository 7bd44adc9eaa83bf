"""A dataset.uri may name the run's interval; a run's first task fills it, and a wrong placeholder is named."""

from __future__ import annotations

import datetime as dt

import pytest

from stagewise.definitions.config import ConfigError, default_model_name
from stagewise.definitions.intervals import fields_in, fill, interval_record, static_prefix
from stagewise.definitions.loading import load_config
from tests.conftest import base_config

HOUR = {"data_interval_start": dt.datetime(2026, 3, 1, 2, tzinfo=dt.UTC),
        "data_interval_end": dt.datetime(2026, 3, 1, 3, tzinfo=dt.UTC),
        "logical_date": dt.datetime(2026, 3, 1, 3, tzinfo=dt.UTC)}


def test_fill_formats_each_time_by_its_own_spec():
    """strftime formats apply per placeholder; none gives an ISO time in UTC."""
    assert fill("raw/ev/{data_interval_start:%Y/%m/%d/%H}", "dataset.uri", HOUR) == "raw/ev/2026/03/01/02"
    assert fill("raw/{logical_date}", "dataset.uri", HOUR) == "raw/2026-03-01T03:00:00"
    assert interval_record(HOUR)["start"] == "2026-03-01T02:00:00+00:00"


def test_a_run_without_that_time_and_an_unknown_placeholder_are_named():
    """A manual run with no logical date and a typo in the placeholder fail naming the key and what to do."""
    with pytest.raises(ValueError, match=r"dataset.uri is 'raw/\{logical_date\}', but this run has no logical_date"):
        fill("raw/{logical_date}", "dataset.uri", {"logical_date": None})
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \['logical'\]"):
        fields_in("raw/{logical}", "dataset.uri")


def test_the_config_refuses_a_bad_placeholder_and_keeps_one_model_name(write_config, storage_root):
    """Config validation names dataset.uri; the registry name and the asset come from the folder before the
    placeholder, so every interval's data trains one model."""
    raw = base_config(storage_root)
    raw["dataset"]["uri"] = "raw/{day}"
    with pytest.raises(ConfigError, match="dataset.uri"):
        load_config(write_config(raw))
    raw["dataset"]["uri"] = "raw/digits/{logical_date:%Y%m%d}"
    config = load_config(write_config(raw))
    assert static_prefix(config.dataset.uri) == "raw/digits"
    assert default_model_name(config.dataset.uri) == "digits"
