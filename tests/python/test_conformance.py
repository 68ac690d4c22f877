"""Both clients, one list of calls (tests/data/conformance_calls.json), one real server: what
each client sent and what it got back must agree.

Between the clients and the server sits a recording proxy (a grpc.server with a generic
handler that forwards every /remotehead.v1.HeadService/* call as raw bytes, unary and
streaming, and records the request messages). The Python client runs the calls here; the C++
client runs them in tests/client/conformance_driver.cc (REMOTEHEAD_CONFORMANCE_DRIVER, default
the build tree's), which writes its results to a file. Each run creates its heads and drops them
at the end, so both start from the same server state. Compared, call by call:
- the StepHeader (equal as messages; the server's random inputs_handle is the one field that
  legitimately differs, so a handle is compared as "present"), the number of row messages, their
  row_offsets and their whole content, and the other requests (CreateHead, DropHead, ...);
- the results: the loss, dX, outputs, dW, db and summary numbers to relative 1e-6 (the server
  cuts engine batches at fixed rows, so equal requests give equal bits, but the relative bound
  keeps the comparison about the clients; summary.chunk_rows / num_chunks, which report the
  engine's chunking, are compared only as "some");
  valid_tokens, versions, flags and head descriptions exactly; a refused call's code, and text
  its message must contain.
A trainer that moves (test_both_clients_follow_a_moved_trainer_alike): rank 1 of fronts [the
proxy, a port nothing listens on] — its step fails at its own front for good, both clients probe
the proxy's server with the same DescribeHead (HeadRef.trainer_rank 1), move there and report
REPLICA_MOVED with the same metadata; the step asked again reaches it the same.
"""

import concurrent.futures
import json
import os
import subprocess
import threading

import grpc
import pytest
import torch

import numerics
import remotehead
from conftest import ROOT
from remotehead.local_server import free_port
from remotehead.v1 import head_service_pb2 as pb

CALLS = ROOT / "tests" / "data" / "conformance_calls.json"
SERVICE = "remotehead.v1.HeadService"
DRIVER = os.environ.get("REMOTEHEAD_CONFORMANCE_DRIVER",
                        str(ROOT / "build" / "tests" / "remotehead-conformance-driver"))
REQUEST_TYPES = {m.name: m.input_type.name
                 for m in pb.DESCRIPTOR.services_by_name["HeadService"].methods}
STEP_RPCS = ("ForwardBackward", "Forward", "Backward")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
REL = 1e-6


class RecordingProxy:
    """Forwards every HeadService call to `upstream` as raw bytes and records, per call in
    arrival order, the method, its request messages (serialised) and whether the server
    refused it."""

    def __init__(self, upstream: str):
        self.channel = grpc.insecure_channel(upstream)
        self.lock = threading.Lock()
        self.records = []  # [(method name, [request bytes, ...], {"refused": bool})]
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
        self.server.add_generic_rpc_handlers((self._Handler(self),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.target = f"127.0.0.1:{port}"

    class _Handler(grpc.GenericRpcHandler):
        def __init__(self, proxy):
            self.proxy = proxy

        def service(self, details):
            prefix = f"/{SERVICE}/"
            if not details.method.startswith(prefix):
                return None
            method = pb.DESCRIPTOR.services_by_name["HeadService"].methods_by_name.get(
                details.method[len(prefix):])
            if method is None:
                return None
            return self.proxy._handler(details.method, method)

    def _record(self, name):
        requests, outcome = [], {"refused": False}
        with self.lock:
            self.records.append((name, requests, outcome))
        return requests, outcome

    def _handler(self, path, method):
        """A pass-through handler of the method's kind: requests are recorded as they go."""
        name = method.name
        if not method.client_streaming and not method.server_streaming:
            upstream = self.channel.unary_unary(path)

            def unary_unary(request, context):
                requests, outcome = self._record(name)
                requests.append(request)
                return self._relay(context, outcome, lambda: upstream(request))
            return grpc.unary_unary_rpc_method_handler(unary_unary)
        if not method.client_streaming:
            upstream = self.channel.unary_stream(path)

            def unary_stream(request, context):
                requests, outcome = self._record(name)
                requests.append(request)
                yield from self._relay_stream(context, outcome, lambda: upstream(request))
            return grpc.unary_stream_rpc_method_handler(unary_stream)

        def recorded(iterator, requests):
            for request in iterator:
                requests.append(request)
                yield request
        if not method.server_streaming:
            upstream = self.channel.stream_unary(path)

            def stream_unary(iterator, context):
                requests, outcome = self._record(name)
                return self._relay(context, outcome,
                                   lambda: upstream(recorded(iterator, requests)))
            return grpc.stream_unary_rpc_method_handler(stream_unary)
        upstream = self.channel.stream_stream(path)

        def stream_stream(iterator, context):
            requests, outcome = self._record(name)
            yield from self._relay_stream(context, outcome,
                                          lambda: upstream(recorded(iterator, requests)))
        return grpc.stream_stream_rpc_method_handler(stream_stream)

    @staticmethod
    def _relay(context, outcome, call):
        try:
            return call()
        except grpc.RpcError as e:
            outcome["refused"] = True
            context.abort(e.code(), e.details())

    @staticmethod
    def _relay_stream(context, outcome, call):
        try:
            yield from call()
        except grpc.RpcError as e:
            outcome["refused"] = True
            context.abort(e.code(), e.details())

    def take(self):
        with self.lock:
            records, self.records = self.records, []
        return records

    def stop(self):
        self.server.stop(grace=None)
        self.channel.close()


# ----- the calls, through the Python client -----

def generate(spec):
    """The calls file's input formulas (computed exactly in integers, then scaled)."""
    rows, d, seed = spec["rows"], spec["hidden_size"], spec["seed"]
    i = torch.arange(rows, dtype=torch.int64)
    j = torch.arange(d, dtype=torch.int64)
    hidden = (((31 * i[:, None] + 17 * j[None, :] + 13 * seed) % 61 - 30).double() / 32)
    inputs = {"hidden": hidden.to(DTYPES[spec["hidden_dtype"]]), "targets": None,
              "weights": None, "aux": None}
    if "targets" in spec:
        t = spec["targets"]
        targets = (7 * i + 3 * seed) % t["vocab_size"]
        every = t["ignore_every"]
        if every > 0:
            targets[i % every == every - 1] = t["ignore_value"]
        inputs["targets"] = targets
    if spec.get("weights"):
        inputs["weights"] = (((5 * i + seed) % 4 + 1).double() / 4).float()
    if "aux" in spec:
        inputs["aux"] = {a["name"]: (a["offset"] + (((3 + 2 * k) * i + seed + k) % 9 - 4)
                                     .double() / 64).float()
                         for k, a in enumerate(spec["aux"])}
    per_token_grad = (((11 * i + seed) % 7 - 3).double() / 8).float()
    return inputs, per_token_grad


def step_options(call, handles):
    o = dict(call.get("options", {}))
    if "wire_dtype" in o:
        o["wire_dtype"] = DTYPES[o["wire_dtype"]]
    if "logits_dtype" in o:
        o["logits_dtype"] = DTYPES[o["logits_dtype"]]
    if "gradient_id" in o:
        o["gradient_id"] = remotehead.GradientId(*o["gradient_id"])
    if "inputs_handle_from" in call:
        o["inputs_handle"] = handles[call["inputs_handle_from"]]
    return remotehead.StepOptions(**o)


def flat(t):
    return None if t is None else t.double().reshape(-1).tolist()


def info_dict(info):
    names = {v: k for k, v in DTYPES.items()}
    return {"head_id": info.head_id, "vocab_size": info.vocab_size,
            "hidden_size": info.hidden_size, "dtype": names[info.dtype],
            "has_bias": info.has_bias, "device": info.device,
            "weight_version": info.weight_version,
            "accumulated_micro_batches": info.accumulated_micro_batches}


def summary_dict(s):
    return {"loss": s.loss, "valid_tokens": s.valid_tokens, "denominator": s.denominator,
            "extras": s.extras, "weight_version": s.weight_version, "replayed": s.replayed,
            "chunk_rows": s.chunk_rows, "num_chunks": s.num_chunks,
            "inputs_handle": s.inputs_handle}


def run_python(target, calls, **client_options):
    clients, handles, results = {}, {}, []
    for call in calls:
        chunk_bytes = call.get("chunk_bytes", 1 << 20)
        client = clients.setdefault(chunk_bytes, remotehead.Client(
            target, chunk_bytes=chunk_bytes, **client_options))
        try:
            result = {"ok": True, **run_python_call(client, call, handles)}
        except remotehead.RemoteheadError as e:
            result = {"ok": False, "code": e.code.name, "message": e.details,
                      "reason": e.reason, "metadata": e.metadata}
        results.append({"name": call["name"], **result})
    for client in clients.values():
        client.close()
    return results


def run_python_call(client, call, handles):
    rpc, head_id = call["rpc"], call["head_id"]
    if rpc == "CreateHead":
        return {"info": info_dict(client.create_head(
            head_id, call["vocab_size"], call["hidden_size"], dtype=DTYPES[call["dtype"]],
            bias=call["bias"], seed=call["seed"]))}
    if rpc == "DropHead":
        client.drop_head(head_id)
        return {}
    if rpc == "FetchGradients":
        dw, db, info = client.fetch_gradients(head_id)
        return {"weight_grad": flat(dw), "bias_grad": flat(db), "info": info_dict(info)}
    options = step_options(call, handles)
    inputs, per_token_grad = generate(call["inputs"])
    args = (head_id, inputs["hidden"], inputs["targets"])
    kwargs = {"weights": inputs["weights"], "aux": inputs["aux"]}
    if rpc == "ForwardBackward":
        r = client.forward_backward(*args, options, **kwargs)
    elif rpc == "Forward":
        r = client.forward(*args, options, **kwargs)
        handles[call["name"]] = r.summary.inputs_handle
    else:
        go = call["grad_output"]
        grad_output = per_token_grad if go.get("per_token") else torch.tensor(go["scalar"])
        r = client.backward(*args, grad_output, options, **kwargs)
    return {"loss": r.summary.loss if rpc != "ForwardBackward" else r.loss,
            "grad_hidden": flat(r.grad_hidden), "outputs": flat(r.outputs),
            "summary": summary_dict(r.summary),
            "token_extras": {name: flat(t) for name, t in r.token_extras.items()}}


# ----- the comparison -----

def parse(name, requests):
    """The recorded request messages of one RPC, parsed; a step's inputs handle (random, from
    the server) is replaced by a placeholder that says only whether one was sent."""
    messages = [getattr(pb, REQUEST_TYPES[name]).FromString(r) for r in requests]
    if name in STEP_RPCS and messages and messages[0].HasField("header"):
        header = messages[0].header
        if header.inputs_handle:
            header.inputs_handle = "<handle>"
    return messages


def close(a, b):
    return numerics.close(torch.tensor(a, dtype=torch.float64),
                          torch.tensor(b, dtype=torch.float64), REL)


def compare_results(call, py, cpp):
    name = call["name"]
    assert py["ok"] == cpp["ok"], f"{name}: python {py}, c++ {cpp}"
    if "expect_error" in call:
        assert not py["ok"], f"{name}: expected {call['expect_error']}; the call succeeded"
        assert py["code"] == cpp["code"] == call["expect_error"], (name, py, cpp)
        for text in call.get("message_contains", []):
            assert text in py["message"] and text in cpp["message"], (name, py, cpp)
        return
    assert py["ok"], f"{name}: {py}"
    assert set(py) == set(cpp), (name, sorted(py), sorted(cpp))
    for key in ("grad_hidden", "outputs", "weight_grad", "bias_grad"):
        if key in py:
            assert (py[key] is None) == (cpp[key] is None), (name, key)
            if py[key] is not None:
                assert len(py[key]) == len(cpp[key]), (name, key)
                assert close(py[key], cpp[key]), (
                    f"{name}: {key} differs: relative error "
                    f"{numerics.relative_error(torch.tensor(py[key]), torch.tensor(cpp[key]))}")
    if "token_extras" in py:
        assert sorted(py["token_extras"]) == sorted(cpp["token_extras"]) == sorted(
            call["options"].get("token_extras", [])), (name, py["token_extras"], cpp["token_extras"])
        for extra, values in py["token_extras"].items():
            assert close(values, cpp["token_extras"][extra]), (name, extra)
    if "loss" in py:
        assert close(py["loss"], cpp["loss"]), (name, py["loss"], cpp["loss"])
    if "info" in py:
        assert py["info"] == cpp["info"], name
    if "summary" in py:
        ps, cs = py["summary"], cpp["summary"]
        for key in ("valid_tokens", "weight_version", "replayed"):
            assert ps[key] == cs[key], (name, key, ps[key], cs[key])
        # How the server grouped the rows into engine batches depends on how the messages
        # happened to arrive (it computes what it has when nothing more is queued): not a
        # property of the client.
        for key in ("chunk_rows", "num_chunks"):
            assert (ps[key] > 0) == (cs[key] > 0), (name, key, ps[key], cs[key])
        assert bool(ps["inputs_handle"]) == bool(cs["inputs_handle"]), name
        for key in ("loss", "denominator"):
            assert close(ps[key], cs[key]), (name, key, ps[key], cs[key])
        assert ps["extras"].keys() == cs["extras"].keys(), name
        for key in ps["extras"]:
            assert close(ps["extras"][key], cs["extras"][key]), (name, key)


def compare_requests(py_records, cpp_records):
    """Both clients made the same RPCs, in the same order, with the same messages."""
    # The C++ client describes a head before streaming its gradients into a preallocated
    # tensor (one DescribeHead before each FetchGradients); the Python client does not need to.
    cpp_records = [r for r in cpp_records if r[0] != "DescribeHead"]
    # Each client (one per chunk_bytes) asks for the function list once (ListFunctions) before
    # its first step with targets (whether the rows that contribute nothing stay behind) or
    # per-row Forward (what the rows come back as), and both at the same points of the calls.
    names = [[r[0] for r in records] for records in (py_records, cpp_records)]
    at = [[i for i, n in enumerate(names_) if n == "ListFunctions"] for names_ in names]
    assert at[0] == at[1] and at[0], names
    py_records = [r for r in py_records if r[0] != "ListFunctions"]
    cpp_records = [r for r in cpp_records if r[0] != "ListFunctions"]
    assert [r[0] for r in py_records] == [r[0] for r in cpp_records]
    for (name, py_requests, py_outcome), (_, cpp_requests, cpp_outcome) in zip(py_records,
                                                                              cpp_records):
        assert py_outcome == cpp_outcome, f"{name}: refused by the server for one client only"
        py_messages, cpp_messages = parse(name, py_requests), parse(name, cpp_requests)
        if py_outcome["refused"] and name in STEP_RPCS:
            # The server stops reading at its refusal: how many row messages the client had
            # sent by then is a matter of timing. The header and the rows both sent must agree.
            n = min(len(py_messages), len(cpp_messages))
            py_messages, cpp_messages = py_messages[:n], cpp_messages[:n]
        if name in STEP_RPCS:
            assert py_messages[0].header == cpp_messages[0].header, (
                f"{name}: headers differ\npython:\n{py_messages[0].header}\n"
                f"c++:\n{cpp_messages[0].header}")
            offsets = [[m.rows.row_offset for m in ms[1:]] for ms in (py_messages,
                                                                     cpp_messages)]
            assert offsets[0] == offsets[1], (name, offsets)
        assert py_messages == cpp_messages, f"{name}: request messages differ"


@pytest.fixture(scope="module")
def proxy(server_target):
    p = RecordingProxy(server_target)
    yield p
    p.stop()


def drop_leftovers(target, calls):
    """Heads a failed earlier run may have left behind (not through the proxy)."""
    with remotehead.Client(target) as client:
        for head_id in {c["head_id"] for c in calls if c["rpc"] == "CreateHead"}:
            try:
                client.drop_head(head_id)
            except remotehead.RemoteheadError as e:
                assert e.code == grpc.StatusCode.NOT_FOUND


def test_both_clients_send_the_same_requests_and_get_the_same_results(server_target, proxy,
                                                                       tmp_path):
    if not os.path.exists(DRIVER):
        pytest.fail(f"{DRIVER}: the C++ conformance driver is not built "
                    f"(cmake --build build --target remotehead_conformance_driver)")
    calls = json.loads(CALLS.read_text())["calls"]

    drop_leftovers(server_target, calls)
    proxy.take()
    py_results = run_python(proxy.target, calls)
    py_records = proxy.take()

    drop_leftovers(server_target, calls)
    out = tmp_path / "cpp_results.json"
    run = subprocess.run([DRIVER, f"--target={proxy.target}", f"--calls={CALLS}",
                          f"--out={out}"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    cpp_records = proxy.take()
    cpp_results = json.loads(out.read_text())["calls"]

    assert [r["name"] for r in cpp_results] == [c["name"] for c in calls]
    for call, py, cpp in zip(calls, py_results, cpp_results):
        compare_results(call, py, cpp)
    compare_requests(py_records, cpp_records)

    # What the comparison covers: every step kind, several row messages, no rows at all (a
    # scalar Backward by handle), and refusals that never reached the server.
    # (Rows of a call the server refused are not counted: how many it read is timing.)
    steps = [(name, parse(name, requests), outcome) for name, requests, outcome in py_records
             if name in STEP_RPCS]
    served = [(name, messages) for name, messages, outcome in steps if not outcome["refused"]]
    assert {name for name, _ in served} == set(STEP_RPCS)
    assert max(len(messages) - 1 for _, messages in served) >= 4
    assert min(len(messages) - 1 for _, messages in served) == 0
    refused_here = [c for c in calls if c.get("expect_error") == "INVALID_ARGUMENT"]
    assert len(steps) == sum(1 for c in calls if c["rpc"] in STEP_RPCS) - len(refused_here)


def unused_address() -> str:
    """A loopback address nothing listens on."""
    return f"127.0.0.1:{free_port()}"


def test_both_clients_follow_a_moved_trainer_alike(server_target, proxy, tmp_path):
    """Trainer 1 of fronts [the proxy, a front that is gone]: its step fails there for good; each
    client probes the fronts from the next one (the proxy's server serves every trainer), dials
    it from then on and reports the move (UNAVAILABLE, REPLICA_MOVED, from replica 1 to 0, the
    head's incarnation and version there); the step asked again goes there. compact_rows off:
    the function list, which a step with targets reads first at the trainer's own front, plays
    no part."""
    head = "conformance-move"
    step = {"rpc": "ForwardBackward", "head_id": head,
            "inputs": {"rows": 6, "hidden_size": 8, "seed": 3, "hidden_dtype": "float32",
                       "targets": {"vocab_size": 20, "ignore_every": 0, "ignore_value": -100}},
            "options": {"reduction": "sum", "gradient_id": ["mover/rank-1", 0, 0],
                        "compact_rows": False}}
    calls = [{"name": "create", "rpc": "CreateHead", "head_id": head, "vocab_size": 20,
              "hidden_size": 8, "seed": 2, "dtype": "float32", "bias": False},
             {"name": "moved", **step, "expect_error": "UNAVAILABLE"},
             {"name": "again", **step},
             {"name": "drop", "rpc": "DropHead", "head_id": head}]
    (tmp_path / "calls.json").write_text(json.dumps({"calls": calls}))
    fronts = [proxy.target, unused_address()]

    drop_leftovers(server_target, calls)
    proxy.take()
    py_results = run_python(fronts, calls, rank=1)
    py_records = proxy.take()
    drop_leftovers(server_target, calls)
    out = tmp_path / "cpp_results.json"
    run = subprocess.run([DRIVER, f"--target={proxy.target}", f"--fronts={','.join(fronts)}",
                          "--rank=1", f"--calls={tmp_path / 'calls.json'}", f"--out={out}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    cpp_records = proxy.take()
    cpp_results = json.loads(out.read_text())["calls"]

    for call, py, cpp in zip(calls, py_results, cpp_results, strict=True):
        compare_results(call, py, cpp)
    moved = [r for r in (py_results[1], cpp_results[1])]
    assert [r["reason"] for r in moved] == ["REPLICA_MOVED"] * 2, moved
    assert [(r["metadata"]["from_replica"], r["metadata"]["to_replica"]) for r in moved] == [
        ("1", "0")] * 2, moved
    # The same RPCs with the same messages: the probe names the trainer; nothing of the moved
    # step reached the new front, the step asked again did.
    names = [[name for name, _, _ in records] for records in (py_records, cpp_records)]
    assert names == [["CreateHead", "DescribeHead", "ForwardBackward", "DropHead"]] * 2, names
    for (name, py_requests, _), (_, cpp_requests, _) in zip(py_records, cpp_records):
        assert parse(name, py_requests) == parse(name, cpp_requests), name
    probe = parse("DescribeHead", py_records[1][1])[0]
    assert (probe.head_id, probe.HasField("trainer_rank"), probe.trainer_rank) == (head, True, 1)
