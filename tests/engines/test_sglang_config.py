"""The SGLang backend's configuration: server args, KV events endpoints, sampling parameters.

See tests/engines/_sglang_fakes.py for how the fakes follow the record.
"""

from __future__ import annotations

import json

import pytest

from actors.serving.engines._sglang import SGLangEngine
from actors.serving.engines._sglang._config import (
    force_server_args,
    kv_events_config,
    kv_events_endpoints,
    sampling_params,
)
from protocols.engine import (
    Grammar,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from tests.engines._sglang_fakes import (
    FakeSGLang,
    Record,
    check_kv_events_config,
)

# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------


def test_kv_events_config_binds_loopback_only() -> None:
    cfg = json.loads(
        kv_events_config('{"publisher": "zmq", "endpoint": "tcp://*:5557"}', 2, False) or ""
    )
    assert cfg == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True}
    assert kv_events_endpoints(json.dumps(cfg), 2) == (
        "tcp://127.0.0.1:5557",
        "tcp://127.0.0.1:5558",
    )
    cfg = json.loads(
        kv_events_config(
            {
                "publisher": "zmq",
                "endpoint": "tcp://0.0.0.0:6000",
                "replay_endpoint": "tcp://*:6100",
            },
            1,
            False,
        )
        or ""
    )
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (
        "tcp://127.0.0.1:6000",
        "tcp://127.0.0.1:6100",
    )
    replay = kv_events_endpoints(json.dumps(cfg), 2, "replay_endpoint")
    assert replay == ("tcp://127.0.0.1:6100", "tcp://127.0.0.1:6101")
    assert kv_events_endpoints(json.dumps({"endpoint": "ipc:///x"}), 1, "replay_endpoint") == ()
    ipc = kv_events_config({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}, 1, False)
    assert kv_events_endpoints(ipc, 1) == ("ipc:///tmp/kv",)
    with pytest.raises(ValueError, match="per DP rank"):
        kv_events_config({"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}, 2, False)
    with pytest.raises(ValueError, match="only tcp"):
        kv_events_config({"publisher": "zmq", "endpoint": "inproc://kv"}, 1, False)
    assert kv_events_config(None, 1, False) is None
    assert kv_events_config('{"publisher": "null"}', 1, True) is None
    made = json.loads(kv_events_config(None, 1, True) or "")
    assert made["endpoint"].startswith("tcp://127.0.0.1:") and made["bind"] is True


def test_kv_events_config_without_bind_uses_a_private_ipc_path() -> None:
    """SGLang without ``KVEventsConfig.bind`` (0.5.17) connects to a concrete tcp host instead of
    binding it: the publisher gets a private ipc path (one DP rank), or a clear error."""
    made = json.loads(kv_events_config(None, 1, True, can_bind=False) or "")
    assert made["publisher"] == "zmq" and "bind" not in made
    assert made["endpoint"].startswith("ipc:///") and "actorserve-kv-" in made["endpoint"]
    assert kv_events_endpoints(json.dumps(made), 1) == (made["endpoint"],)
    other = json.loads(kv_events_config(None, 1, True, can_bind=False) or "")
    assert other["endpoint"] != made["endpoint"]  # private to each engine
    given = json.loads(
        kv_events_config(
            {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6100"},
            1,
            False,
            can_bind=False,
        )
        or ""
    )
    assert given["endpoint"].startswith("ipc://")
    assert given["replay_endpoint"] == "tcp://127.0.0.1:6100"  # SGLang always binds replay
    ipc = {"publisher": "zmq", "endpoint": "ipc:///tmp/kv"}
    assert json.loads(kv_events_config(ipc, 1, False, can_bind=False) or "") == ipc
    for raw in (None, {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}):
        with pytest.raises(ValueError, match="dp_size > 1"):
            kv_events_config(raw, 2, True, can_bind=False)
    assert kv_events_config(None, 2, False, can_bind=False) is None  # no KV events, no error


def test_kv_events_config_suits_each_recorded_sglang(record: Record) -> None:
    """The config made for a version's fields is one its publisher binds on loopback; ``bind``
    sent to a version without it would be silently ignored (and the publisher would connect)."""
    can_bind = "bind" in record.fields("KVEventsConfig")
    for raw in (None, {"publisher": "zmq", "endpoint": "tcp://*:5557"}):
        check_kv_events_config(record, kv_events_config(raw, 1, True, can_bind=can_bind) or "")
    if not can_bind:
        with pytest.raises(ValueError, match="ignore"):
            check_kv_events_config(record, kv_events_config(None, 1, True) or "")
    with pytest.raises(ValueError, match="connect"):
        check_kv_events_config(record, '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1"}')


def test_server_args_are_checked(fake: FakeSGLang) -> None:
    with pytest.raises(ValueError, match="contradicts"):
        SGLangEngine({"model_path": "m", "disaggregation_mode": "decode"}, role="prefill")
    with pytest.raises(ValueError, match="nixl"):
        SGLangEngine(
            {"model_path": "m", "disaggregation_transfer_backend": "mooncake"}, role="decode"
        )
    with pytest.raises(ValueError, match="role"):
        SGLangEngine({"model_path": "m"}, role="mixed")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        SGLangEngine({"model_path": "m", "skip_tokenizer_init": False})
    api = fake.api()
    with pytest.raises(ValueError, match="unknown SGLang"):
        force_server_args(
            {"model_path": "m", "no_such_arg": 1},
            role="aggregated",
            api=api,
            bootstrap_port=None,
            memory_release=False,
            kv_events=None,
        )
    out = force_server_args(
        {"model_path": "m", "disaggregation_bootstrap_port": 7777},
        role="decode",
        api=api,
        bootstrap_port=7777,
        memory_release=False,
        kv_events=None,
    )
    assert (
        out["disaggregation_bootstrap_port"] == 7777
        and out["disaggregation_transfer_backend"] == "nixl"
    )


def test_sampling_params_mapping(record: Record) -> None:
    req = PreprocessedRequest(
        rid="s",
        token_ids=[1],
        stop_conditions=StopConditions(
            max_tokens=5, min_tokens=2, stop_token_ids=[9], ignore_eos=True, stop=["x"]
        ),
        sampling_options=SamplingOptions(
            top_p=0.9,
            min_p=0.1,
            repetition_penalty=1.1,
            guided_decoding=Grammar(kind="regex", spec=r"(a|b\.c)"),
        ),
    )
    sp = sampling_params(req)
    assert sp == {
        "max_new_tokens": 5,
        "min_new_tokens": 2,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "top_p": 0.9,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "regex": r"(a|b\.c)",
    }
    record.sampling_params.bind(**sp)  # every key is one of this SGLang's sampling params
    guided = sampling_params(
        PreprocessedRequest(
            rid="g",
            token_ids=[1],
            sampling_options=SamplingOptions(guided_decoding=Grammar(kind="ebnf", spec="g")),
        )
    )
    assert guided == {"ebnf": "g"}


@pytest.mark.parametrize(
    ("grammar", "expected"),
    [
        (
            Grammar(kind="json_schema", spec='{"type": "string"}'),
            {"json_schema": '{"type": "string"}'},
        ),
        # What SGLang's own OpenAI server sends for response_format json_object.
        (Grammar(kind="json_object"), {"json_schema": '{"type": "object"}'}),
        (Grammar(kind="regex", spec="a+"), {"regex": "a+"}),
        (Grammar(kind="ebnf", spec='root ::= "a"'), {"ebnf": 'root ::= "a"'}),
        (
            Grammar(kind="structural_tag", spec='{"structures": []}'),
            {"structural_tag": '{"structures": []}'},
        ),
    ],
)
def test_every_grammar_kind_and_logit_bias_are_sglang_sampling_params(
    record: Record, grammar: Grammar, expected: dict[str, str]
) -> None:
    req = PreprocessedRequest(
        rid="g",
        token_ids=[1],
        sampling_options=SamplingOptions(guided_decoding=grammar, logit_bias={5: -100, 7: 2.5}),
    )
    sp = sampling_params(req)
    # SGLang's logit_bias is keyed by the token id as a string (its JSON form).
    assert sp == {**expected, "logit_bias": {"5": -100.0, "7": 2.5}}
    record.sampling_params.bind(**sp)  # every key is one of this SGLang's sampling params
