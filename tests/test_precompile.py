"""PreCompileConfig: expansion, stable hashing, power-of-two buckets, validation, serialization."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculative.precompile import PreCompileConfig as P

REPO = Path(__file__).resolve().parents[1]


def pairs(config):
    return [(s.batch_size, s.prefill_length, s.required_props) for s in config.get_standalones()]


def test_expansion_equal_lists():
    config = P(batch_size=[1, 2, 4], prefill_length=[64, 128, 256])
    assert not config.is_standalone
    assert pairs(config) == [(1, 64, None), (2, 128, None), (4, 256, None)]
    assert all(s.is_standalone for s in config.get_standalones())


def test_expansion_unequal_lists_repeat_last_element():
    config = P(batch_size=[1, 2], prefill_length=[64, 128, 256, 512], required_props=[{"a": 1}])
    assert pairs(config) == [(1, 64, {"a": 1}), (2, 128, {"a": 1}), (2, 256, {"a": 1}), (2, 512, {"a": 1})]
    # scalars are shared by every standalone; only one list
    assert pairs(P(batch_size=8, prefill_length=[32, 64])) == [(8, 32, None), (8, 64, None)]
    assert pairs(P(batch_size=[1, 2, 3])) == [(1, None, None), (2, None, None), (3, None, None)]
    # a list of dicts expands too, and standalones do not share mutable props
    config = P(required_props=[{"x": [1]}, {"y": 2}])
    first = config.get_standalones()[0]
    first.required_props["x"].append(2)
    assert config.required_props == [{"x": [1]}, {"y": 2}]


def test_standalone_returns_itself():
    config = P(batch_size=2, prefill_length=128, required_props={"k": "v"})
    assert config.is_standalone
    assert config.get_standalones() == [config] and config.get_standalones()[0] is config
    single = P(batch_size=[4])
    assert not single.is_standalone and pairs(single) == [(4, None, None)]


def test_tuples_are_stored_as_lists():
    assert P(batch_size=(1, 2), prefill_length=(64,)) == P(batch_size=[1, 2], prefill_length=[64])


HASH_CONFIG = {"batch_size": [1, 2], "prefill_length": [64, 128], "required_props": {"b": 1, "a": [1, 2]}}


def test_hash_is_stable_across_processes():
    value = P(**HASH_CONFIG).get_default_hash()
    assert isinstance(value, int) and 0 <= value < 2**63
    assert value == P(**HASH_CONFIG).get_default_hash()
    assert value == P(**{**HASH_CONFIG, "required_props": {"a": [1, 2], "b": 1}}).get_default_hash()
    code = (
        "import json, sys; from speculative.precompile import PreCompileConfig as P; "
        "print(P(**json.loads(sys.argv[1])).get_default_hash())"
    )
    for seed in ("0", "12345"):  # a different str-hash seed must not matter
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(HASH_CONFIG)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(out.stdout.strip()) == value


def test_different_configs_different_hashes():
    configs = [
        P(),
        P(batch_size=2),
        P(batch_size=[1]),
        P(prefill_length=64),
        P(prefill_length=[64, 128]),
        P(prefill_length=[128, 64]),
        P(required_props={"a": 1}),
        P(required_props={"a": 2}),
        P(batch_size=[1, 2], prefill_length=64),
        P(batch_size=[2, 1], prefill_length=64),
    ]
    assert len({c.get_default_hash() for c in configs}) == len(configs)
    assert P(batch_size=2).get_default_hash() == P(batch_size=1).replace(batch_size=2).get_default_hash()


@pytest.mark.parametrize(
    "low, high, expected",
    [
        (64, 512, [64, 128, 256, 512]),
        (50, 300, [64, 128, 256, 512]),
        (64, 64, [64]),
        (100, 128, [128]),
        (1, 8, [1, 2, 4, 8]),
        (3, 5, [4, 8]),
    ],
)
def test_create_optimized_compo_buckets(low, high, expected):
    config = P.create_optimized_compo(batch_size=[1, 4], max_prefill_length=high, min_prefill_length=low)
    assert config.prefill_length == expected and config.batch_size == [1, 4]
    assert config.bucket(high) >= high  # every prompt up to max fits


def test_create_optimized_compo_defaults_and_props():
    config = P.create_optimized_compo()
    assert config.batch_size == 1 and config.prefill_length == [64, 128, 256, 512, 1024, 2048]
    assert P.create_optimized_compo(2, 128, required_props={"a": 1}).required_props == {"a": 1}


def test_bucket_choice_and_error():
    config = P(prefill_length=[256, 64, 128])
    assert [config.bucket(n) for n in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]
    with pytest.raises(
        ValueError, match=r"^prompt of 300 tokens fits no prefill bucket; the largest is 256$"
    ):
        config.bucket(300)
    assert P(prefill_length=32).bucket(20) == 32
    assert P().bucket(777) == 777  # no prefill_length: unchanged
    with pytest.raises(ValueError, match=r"bucket\(\) prefill_length must be an integer >= 1; got 0"):
        config.bucket(0)


INTS = "an integer >= 1 or a non-empty list of them"


PROPS = "None, a JSON-able dict or a non-empty list of them"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("batch_size", 0, f"batch_size must be {INTS}; got 0"),
        ("batch_size", None, f"batch_size must be {INTS}; got None"),
        ("batch_size", 2.0, f"batch_size must be {INTS}; got 2.0"),
        ("batch_size", True, f"batch_size must be {INTS}; got True"),
        ("batch_size", [], f"batch_size must be {INTS}; got []"),
        ("batch_size", [1, -2], f"batch_size must be {INTS}; got [1, -2]"),
        ("prefill_length", 0, f"prefill_length must be None, {INTS}; got 0"),
        ("prefill_length", [], f"prefill_length must be None, {INTS}; got []"),
        ("prefill_length", [64, None], f"prefill_length must be None, {INTS}; got [64, None]"),
        ("prefill_length", "64", f"prefill_length must be None, {INTS}; got '64'"),
        ("required_props", [], f"required_props must be {PROPS}; got []"),
        ("required_props", "x", f"required_props must be {PROPS}; got 'x'"),
        ("required_props", {1: "int key"}, f"required_props must be {PROPS}; got {{1: 'int key'}}"),
        ("required_props", {"t": (1, 2)}, f"required_props must be {PROPS}; got {{'t': (1, 2)}}"),
        ("required_props", {"f": object}, f"required_props must be {PROPS}; got {{'f': <class 'object'>}}"),
        ("required_props", [{"a": 1}, 3], f"required_props must be {PROPS}; got [{{'a': 1}}, 3]"),
    ],
)
def test_validation_errors(field, value, message):
    with pytest.raises(ValueError) as info:
        P(**{field: value})
    assert str(info.value) == f"PreCompileConfig.{message}"


def test_create_optimized_compo_validation():
    with pytest.raises(
        ValueError, match=r"^PreCompileConfig.min_prefill_length must be an integer >= 1; got 0$"
    ):
        P.create_optimized_compo(max_prefill_length=64, min_prefill_length=0)
    with pytest.raises(
        ValueError,
        match=r"^PreCompileConfig.max_prefill_length must be an integer >= "
        r"min_prefill_length \(64\); got 32$",
    ):
        P.create_optimized_compo(max_prefill_length=32, min_prefill_length=64)
    with pytest.raises(ValueError, match=r"^PreCompileConfig.batch_size must be"):
        P.create_optimized_compo(batch_size=0)


def test_replace_revalidates_and_copies():
    config = P(batch_size=2, prefill_length=[64, 128])
    changed = config.replace(prefill_length=256)
    assert changed == P(batch_size=2, prefill_length=256) and config.prefill_length == [64, 128]
    with pytest.raises(ValueError, match=r"PreCompileConfig\.batch_size must be"):
        config.replace(batch_size=0)


def test_extract_dict_json_round_trip():
    config = P(
        batch_size=[1, 2], prefill_length=[64, 128, 256], required_props=[{"a": {"b": [1, 2.5, None]}}]
    )
    data = config.extract()
    assert data == {
        "batch_size": [1, 2],
        "prefill_length": [64, 128, 256],
        "required_props": [{"a": {"b": [1, 2.5, None]}}],
    }
    data["batch_size"].append(9)  # a copy
    assert config.batch_size == [1, 2]
    assert config.to_dict() == config.extract()
    assert P.from_dict(config.to_dict()) == config
    text = config.to_json(indent=2)
    assert json.loads(text) == config.to_dict()
    again = P.from_json(text)
    assert again == config and again.get_default_hash() == config.get_default_hash()
    assert P.from_json(P().to_json()) == P()
    with pytest.raises(ValueError, match=r"no field\(s\) \['vision_included'\]"):
        P.from_dict({"batch_size": 1, "vision_included": True})
    with pytest.raises(ValueError, match=r"PreCompileConfig\.prefill_length must be"):
        P.from_json('{"prefill_length": 0}')
