"""Registry lookup and prediction without Ray: tiny untrained models logged straight to a SQLite store.

Covers the Python API (code2 source text, ppa JSON graphs) and the bad inputs: unknown model,
alias or version, a model of another task, a file that is not valid Python, a missing SQLite
store, an unreachable tracking server (fails fast), each a one-line error (exit 2 from the CLI).
"""
from __future__ import annotations

import time

import pytest

from tests.helpers import PREDICT_SOURCE, log_tiny_model


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry")
    log_tiny_model(tmp, "tiny-code2", "code2")
    uri = log_tiny_model(tmp, "tiny-ppa", "ppa")
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_registered_model_alias("tiny-code2", "champion", "1")
    return {"uri": uri, "tmp": tmp}


def test_code2_predicts_every_function_of_source_text(store):
    from pipeline.registry.predict import FunctionPrediction, load

    model = load("models:/tiny-code2@champion", tracking_uri=store["uri"])
    preds = model.predict(PREDICT_SOURCE)
    assert [p.name for p in preds] == ["get_name", "setValue", "fetch_all_items"]
    assert [p.line for p in preds] == [2, 7, 10]
    assert preds[1].actual == ["set", "value"]
    assert all(isinstance(p, FunctionPrediction) and len(p.predicted) <= 5 for p in preds)
    assert all(tok in model.vocab for p in preds for tok in p.predicted)
    # the same through graphs, and deterministic
    graphs = [d for *_, d in model.source_graphs(PREDICT_SOURCE)]
    assert model.predict(graphs) == [p.predicted for p in preds]


def test_ppa_predicts_json_graphs(store, tmp_path):
    import json

    from pipeline.registry.predict import load

    model = load("models:/tiny-ppa/1", tracking_uri=store["uri"])
    graphs = [{"num_nodes": 4, "edge_index": [[0, 1, 2], [1, 2, 3]], "edge_attr": [[0.1] * 7, [0.5] * 7, [0.9] * 7]},
              {"num_nodes": 2, "edge_index": [[0], [1]], "edge_attr": [[0.3] * 7]}]
    path = tmp_path / "graphs.json"
    path.write_text(json.dumps(graphs))
    out = model.predict_file(path)
    assert [label for label, _ in out] == ["graph 0", "graph 1"]
    assert all(0 <= cls < 37 for _, cls in out)


@pytest.mark.parametrize("uri, match", [
    ("models:/no-such-model@champion", "no-such-model"),
    ("models:/tiny-code2@no-such-alias", "no-such-alias"),
    ("models:/tiny-code2/99", "tiny-code2"),
    ("sat-code2", "expected a model URI"),
])
def test_unknown_model_alias_or_version(store, uri, match):
    from pipeline.registry.predict import load

    with pytest.raises(ValueError, match=match) as info:
        load(uri, tracking_uri=store["uri"])
    assert "\n" not in str(info.value)


def test_model_of_another_task(store, tmp_path):
    from pipeline.registry.predict import load

    source = tmp_path / "mod.py"
    source.write_text(PREDICT_SOURCE)
    with pytest.raises(ValueError, match="is a ppa model; .* needs a code2 model"):
        load("models:/tiny-ppa/1", tracking_uri=store["uri"]).predict_file(source)
    graph_file = tmp_path / "g.json"
    graph_file.write_text("[]")
    with pytest.raises(ValueError, match=r"is a code2 model; .*g\.json \(JSON graphs\) needs a ppa, pattern or cluster model"):
        load("models:/tiny-code2/1", tracking_uri=store["uri"]).predict_file(graph_file)


def test_invalid_python_names_file_and_line(store, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def ok():\n    return 1\n\ndef broken(:\n    pass\n")
    from pipeline.registry.predict import load

    with pytest.raises(ValueError, match=r"broken\.py:4: not valid Python"):
        load("models:/tiny-code2@champion", tracking_uri=store["uri"]).predict_file(bad)


def test_cli_errors_are_one_line_exit_2(store, tmp_path, capsys):
    from pipeline.cli import main

    source = tmp_path / "mod.py"
    source.write_text(PREDICT_SOURCE)
    bad = tmp_path / "broken.py"
    bad.write_text("x = (\n")
    cases = [
        (["predict", "models:/nope@champion", str(source), "--tracking-uri", store["uri"]], "nope"),
        (["predict", "models:/tiny-ppa/1", str(source), "--tracking-uri", store["uri"]], "ppa model"),
        (["predict", "models:/tiny-code2@champion", str(bad), "--tracking-uri", store["uri"]], "broken.py:1"),
        (["predict", "models:/tiny-code2@champion", str(tmp_path / "missing.py"), "--tracking-uri", store["uri"]], "no such file"),
        (["predict", "models:/tiny-code2@champion", str(source), "--tracking-uri", f"sqlite:///{tmp_path}/none.db"], "no such SQLite"),
        (["models", "--tracking-uri", f"sqlite:///{tmp_path}/none.db"], "no such SQLite"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("satp: error: ") and needle in err and "\n" not in err, (argv, err)
    assert not (tmp_path / "none.db").exists()  # no empty store created by mistake
    assert main(["predict", "models:/tiny-code2@champion", str(source), "--tracking-uri", store["uri"]]) == 0
    out = capsys.readouterr().out
    assert "get_name" in out and "fetch_all_items" in out


def test_unreachable_tracking_server_fails_fast(capsys):
    from pipeline.cli import main
    from pipeline.registry.predict import load

    with pytest.raises(OSError, match="unreachable"):  # the first call also imports MLflow: not timed
        load("models:/x@champion", tracking_uri="http://127.0.0.1:9")
    # no retries or connection timeouts: a refused connection fails at once (MLflow's default
    # retries would take minutes); the bound is far above the milliseconds this takes anywhere
    start = time.monotonic()
    with pytest.raises(OSError, match="unreachable"):
        load("models:/x@champion", tracking_uri="http://127.0.0.1:9")
    assert main(["models", "--tracking-uri", "http://127.0.0.1:9"]) == 2
    assert "unreachable" in capsys.readouterr().err
    assert time.monotonic() - start < 30


def test_models_lists_versions_and_aliases(store, capsys):
    from pipeline.cli import main

    assert main(["models", "--tracking-uri", store["uri"]]) == 0
    text = capsys.readouterr().out
    assert "tiny-code2" in text and "@champion" in text and "tiny-ppa" in text


GOOD_PPA = {"num_nodes": 3, "edge_index": [[0, 1], [1, 2]], "edge_attr": [[0.1] * 7, [0.2] * 7]}


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a JSON graph file (not UTF-8 text: byte 0 is 0x89)"),
    (b'[{"num_nodes": 3', "graphs.json:1: not valid JSON (Expecting ',' delimiter)"),
    ([GOOD_PPA, {**GOOD_PPA, "num_nodes": 0}], "graph 1: num_nodes 0; expected a positive integer"),
    ([{**GOOD_PPA, "num_nodes": 2.5}], "graph 0: num_nodes 2.5; expected a positive integer"),
    ([{**GOOD_PPA, "edge_index": [[0, 1.5], [1, 2]]}], "graph 0: edge_index holds 1.5; expected integer ids"),
    ([{**GOOD_PPA, "edge_index": [[0, 1.0], [1, 2]]}], "graph 0: edge_index holds 1.0; expected integer ids"),
    ([{**GOOD_PPA, "edge_index": [[0, True], [1, 2]]}], "graph 0: edge_index holds True; expected integer ids"),
    ([{**GOOD_PPA, "edge_index": [[0, 1], [1]]}], "graph 0: edge_index has shape ragged lists; expected [2, E]"),
    ([{**GOOD_PPA, "edge_index": [[0, 1], [1, 3]]}], "graph 0: edge_index holds node 3, outside [0, 3)"),
    ([{**GOOD_PPA, "edge_attr": [[0.1] * 7]}], "graph 0: edge_attr has shape [1, 7]; expected [2, 7]"),
    (["not a graph"], "graph 0: expected an object with num_nodes and edge_index, got str"),
])
def test_bad_json_graphs_name_the_file_and_the_graph(store, tmp_path, capsys, content, message):
    """Random bytes and ``num_nodes: 0`` gave errors naming no file or graph, and
    float node ids were cast to integers without a word."""
    import json

    from pipeline.cli import main

    path = tmp_path / "graphs.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(json.dumps(content))
    assert main(["predict", "models:/tiny-ppa/1", str(path), "--tracking-uri", store["uri"]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"satp: error: {path}") and message in err, err
