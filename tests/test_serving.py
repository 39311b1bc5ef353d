"""``mlflow models serve`` of a registered satp model: bounded requests and satp's lines as answers.

Real scoring servers (``mlflow models serve -m models:/...``, MLflow's uvicorn app) on 127.0.0.1 at a
free port, serving a tiny untrained code2 model registered in a SQLite store; no Ray.

The defects:

* a request had no bound: a valid 5.5 MB source got 504 at 60 s while the server kept a core busy long
  after the answer and after its client left. Now a request over a cap (bytes of source, graphs,
  nodes of a graph, nodes of the request: :mod:`pipeline.registry.limits`) is answered 413 before any
  graph is built, and the work stops at the request's deadline (the server's request timeout);
* a bad input (a missing ``source``, a syntax error) was answered 400 with MLflow's generic "unexpected
  error while evaluating the model" and a traceback with the install's paths; now the message is
  satp's one line and the body holds nothing else.

The model's cost per function is near-linear below the cap of nodes per graph: the graph's nodes are
counted in one pass before any graph is built (checked here against the graphs built).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.mlflow_servers import ROOT, cpu_seconds, launch, stop, wait
from tests.helpers import PREDICT_SOURCE, log_tiny_model, tiny_model

#: settings that lift the caps, for a request whose work outlasts its deadline
UNCAPPED = {"SATP_SERVE_MAX_SOURCE_BYTES": "1000000000", "SATP_SERVE_MAX_GRAPHS": "1000000000",
            "SATP_SERVE_MAX_GRAPH_NODES": "1000000000", "SATP_SERVE_MAX_NODES": "1000000000"}
DEADLINE_S = 3


def _functions(count: int, statements: int = 1) -> str:
    body = "".join(f"    x = a + b * {i}\n" for i in range(statements))
    return "".join(f"def get_value_{k}(a, b):\n{body}\n" for k in range(count))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``{"capped": URL, "uncapped": (process, URL)}``: the model served with the default caps, and
    without caps and a deadline of a few seconds (started together)."""
    tmp = tmp_path_factory.mktemp("serving")
    uri = log_tiny_model(tmp, "tiny-code2", "code2")
    model = ["models", "serve", "-m", "models:/tiny-code2/1", "--env-manager", "local"]
    capped = launch(model, tmp / "capped.log", {"MLFLOW_TRACKING_URI": uri})
    uncapped = launch(model, tmp / "uncapped.log", {"MLFLOW_TRACKING_URI": uri, **UNCAPPED,
                                                   "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": str(DEADLINE_S)})
    try:
        wait(*capped, tmp / "capped.log")
        wait(*uncapped, tmp / "uncapped.log")
        yield {"capped": capped[1], "uncapped": uncapped}
    finally:
        stop(capped[0])
        stop(uncapped[0])


def _post(url: str, inputs: list, timeout: float = 120) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def _refusal(url: str, inputs: list, status: int) -> str:
    """The message of a refusal, after checking that the body holds the status's code and that line only."""
    got, body = _post(url, inputs)
    assert got == status, (got, body[:2000])
    answer = json.loads(body)
    assert set(answer) == {"error_code", "message"}, answer
    assert answer["error_code"] == {400: "INVALID_PARAMETER_VALUE", 413: "REQUEST_LIMIT_EXCEEDED"}[status], answer
    text = body.decode()
    assert "Traceback" not in text and "site-packages" not in text and str(ROOT) not in text, text
    assert "\n" not in answer["message"], answer
    return answer["message"]


def test_a_good_source_is_answered(servers):
    status, body = _post(servers["capped"], [{"source": PREDICT_SOURCE}])
    assert status == 200, body[:2000]
    (rows,) = json.loads(body)["predictions"]
    assert [(row["name"], row["line"]) for row in rows] == [("get_name", 2), ("setValue", 7), ("fetch_all_items", 10)]


def test_bad_inputs_are_answered_with_satps_line(servers):
    url = servers["capped"]
    assert _refusal(url, [{"num_nodes": 3}], 400) == "model input 0: a code2 model takes {'source': Python source text}"
    assert _refusal(url, [{"source": PREDICT_SOURCE}, {"source": "def broken(:\n    pass\n"}], 400) == (
        "<model input 1>:1: not valid Python (invalid syntax)")


@pytest.mark.parametrize("inputs, message", [
    ([{"source": "#" * 1_000_001}],
     "model input 0: the request holds more than 1,000,000 bytes of source (1,000,001 so far; "
     "SATP_SERVE_MAX_SOURCE_BYTES): send fewer or smaller sources"),
    ([{"source": _functions(1_500)}, {"source": _functions(501)}],
     "model input 1: function get_value_500 (line 1501): the request holds more than 2,000 graphs "
     "(SATP_SERVE_MAX_GRAPHS; code2: one per function): send fewer per request"),
    ([{"source": PREDICT_SOURCE + _functions(1, statements=500)}],
     "model input 0: function get_value_0 (line 12): 6,005 nodes, more than the 5,000 of one graph "
     "(SATP_SERVE_MAX_GRAPH_NODES)"),
    ([{"source": _functions(26, statements=330)}],
     "model input 0: function get_value_25 (line 8301): the request holds more than 100,000 nodes (103,090 so "
     "far; SATP_SERVE_MAX_NODES): send fewer or smaller graphs per request"),
], ids=["source bytes", "graphs", "nodes of a graph", "nodes of the request"])
def test_a_request_over_a_cap_is_refused_413(servers, inputs, message):
    assert _refusal(servers["capped"], inputs, 413) == message


def _quiet(proc, within_s: float = 30, window_s: float = 2, busy_s: float = 0.2) -> bool:
    """Whether the server's processes use (almost) no CPU for ``window_s`` at some point ``within_s``."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        before = cpu_seconds(proc)
        time.sleep(window_s)
        if cpu_seconds(proc) - before < busy_s:
            return True
    return False


#: the trial's kind of request: 150,000 small valid functions, 7.3 MB (minutes of work uncapped)
MANY = [{"source": _functions(25_000)} for _ in range(6)]


def test_the_work_stops_when_the_request_is_answered(servers):
    proc, url = servers["uncapped"]
    status, body = _post(url, MANY)
    assert status == 504, (status, body[:500])
    assert _quiet(proc), "the server still works on a request it answered"


def test_the_work_stops_when_the_client_has_left(servers):
    proc, url = servers["uncapped"]
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        _post(url, MANY, timeout=1)  # the client leaves before any answer
    assert _quiet(proc), "the server still works on a request its client left"


def test_the_nodes_counted_before_building_are_the_graphs_nodes():
    """What the caps count (one pass over the source's tree) is what the graphs hold, nested
    functions and methods included."""
    from pipeline.registry.model_format import LoadedModel
    from pipeline.registry.predict import Predictor

    tiny = tiny_model("code2")
    predictor = Predictor(LoadedModel(tiny.model, tiny.task, tiny.config, tiny.vocab, tiny.extra))
    text = PREDICT_SOURCE + "def outer(a):\n    def inner(b):\n        return [b for _ in a]\n    return inner\n"
    counted = [(fn.name, nodes) for fn, nodes in predictor._functions(text, "<t>")]
    built = [(name, data.num_nodes) for name, _, _, data in predictor.source_graphs(text)]
    assert counted == built and len(built) == 5, (counted, built)


@pytest.fixture(scope="module")
def ppa_store(tmp_path_factory):
    return log_tiny_model(tmp_path_factory.mktemp("serving-ppa"), "tiny-ppa", "ppa")


def _ppa_graph(nodes: int) -> dict:
    return {"num_nodes": nodes, "edge_index": [[0], [1]], "edge_attr": [[0.5] * 7]}


def test_json_graphs_over_a_cap_are_refused_by_the_pyfunc(ppa_store, monkeypatch):
    """The caps of JSON graphs, through MLflow's own loader in this process (the settings are read
    when the model loads)."""
    import mlflow.pyfunc

    from pipeline.registry.pyfunc import RequestRefused

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ppa_store)
    monkeypatch.setenv("SATP_SERVE_MAX_GRAPH_NODES", "50")
    monkeypatch.setenv("SATP_SERVE_MAX_NODES", "120")
    model = mlflow.pyfunc.load_model("models:/tiny-ppa/1")
    assert len(model.predict([_ppa_graph(50), _ppa_graph(3)])) == 2
    cases = [([_ppa_graph(51)], "model input: graph 0: 51 nodes, more than the 50 of one graph (SATP_SERVE_MAX_GRAPH_NODES)"),
             ([_ppa_graph(50)] * 3, "model input: graph 2: the request holds more than 120 nodes (150 so far; "
                                    "SATP_SERVE_MAX_NODES): send fewer or smaller graphs per request")]
    for inputs, line in cases:
        with pytest.raises(RequestRefused) as refused:
            model.predict(inputs)
        assert (refused.value.status, refused.value.line) == (413, line)


def test_a_bad_setting_stops_the_model_as_it_loads(ppa_store, monkeypatch):
    import mlflow.pyfunc

    monkeypatch.setenv("MLFLOW_TRACKING_URI", ppa_store)
    monkeypatch.setenv("SATP_SERVE_MAX_NODES", "lots")
    with pytest.raises(ValueError, match=r"^SATP_SERVE_MAX_NODES='lots': expected a positive integer$"):
        mlflow.pyfunc.load_model("models:/tiny-ppa/1")
