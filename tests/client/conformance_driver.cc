// Runs tests/data/conformance_calls.json through the C++ client (its public API only) and writes
// what each call returned — losses, dX, outputs, summaries, gradients, or the error — as JSON,
// for tests/python/test_conformance.py, which runs the same calls through the Python client and
// compares the two (and what reached the server).
//
//   remotehead-conformance-driver --target=HOST:PORT --calls=FILE --out=FILE
//                                 [--fronts=HOST:PORT,HOST:PORT… --rank=N]
//
// --fronts: a mesh's replica fronts (ClientOptions::fronts; with --rank, the trainer's rank):
// test_mesh.py runs calls through them, test_conformance.py a trainer that moves. A failed call's
// result has its code, message, reason and metadata.
//
// Inputs are generated from the formula in the calls file's comment, so no tensor is shipped.
// Exit code: 0 when every call ran (failed calls included: they are results), 2 on bad usage
// or an unreadable file.
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "remotehead/client/client.h"
#include "remotehead/core/error_reason.h"

namespace {

using json = nlohmann::json;
namespace rh = remotehead::client;

torch::ScalarType Dtype(const std::string& name) {
  static const std::map<std::string, torch::ScalarType> kDtypes = {
      {"float32", torch::kFloat},  {"bfloat16", torch::kBFloat16}, {"float16", torch::kHalf},
      {"float64", torch::kDouble}, {"int64", torch::kLong},        {"int32", torch::kInt}};
  const auto it = kDtypes.find(name);
  if (it == kDtypes.end()) throw std::invalid_argument("unknown dtype " + name);
  return it->second;
}

std::string DtypeName(torch::ScalarType dtype) {
  for (const char* name : {"float32", "bfloat16", "float16", "float64", "int64", "int32"}) {
    if (Dtype(name) == dtype) return name;
  }
  return c10::toString(dtype);
}

rh::Reduction ReductionOf(const std::string& name) {
  if (name == "none") return rh::Reduction::kNone;
  if (name == "sum") return rh::Reduction::kSum;
  if (name == "mean") return rh::Reduction::kMean;
  if (name == "weighted_sum") return rh::Reduction::kWeightedSum;
  throw std::invalid_argument("unknown reduction " + name);
}

// The calls file's formulas (exact in float32 and bfloat16; computed in float64, then cast).
struct GeneratedInputs {
  rh::StepInputs inputs;
  torch::Tensor per_token_grad;
};

GeneratedInputs Generate(const json& spec) {
  const int64_t rows = spec["rows"], d = spec["hidden_size"], seed = spec["seed"];
  GeneratedInputs g;
  torch::Tensor hidden = torch::empty({rows, d}, torch::kDouble);
  auto h = hidden.accessor<double, 2>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < d; ++j) h[i][j] = ((31 * i + 17 * j + 13 * seed) % 61 - 30) / 32.0;
  }
  g.inputs.hidden = hidden.to(Dtype(spec["hidden_dtype"]));
  if (spec.contains("targets")) {
    const json& t = spec["targets"];
    const int64_t vocab = t["vocab_size"], every = t["ignore_every"], ignore = t["ignore_value"];
    torch::Tensor targets = torch::empty({rows}, torch::kLong);
    for (int64_t i = 0; i < rows; ++i) {
      targets[i] = every > 0 && i % every == every - 1 ? ignore : (7 * i + 3 * seed) % vocab;
    }
    g.inputs.targets = targets;
  }
  if (spec.value("weights", false)) {
    torch::Tensor weights = torch::empty({rows}, torch::kFloat);
    for (int64_t i = 0; i < rows; ++i) weights[i] = ((5 * i + seed) % 4 + 1) / 4.0;
    g.inputs.weights = weights;
  }
  if (spec.contains("aux")) {
    int64_t k = 0;
    for (const json& a : spec["aux"]) {
      const double offset = a["offset"];
      torch::Tensor values = torch::empty({rows}, torch::kDouble);
      for (int64_t i = 0; i < rows; ++i) {
        values[i] = offset + (((3 + 2 * k) * i + seed + k) % 9 - 4) / 64.0;
      }
      g.inputs.aux[a["name"].get<std::string>()] = values.to(torch::kFloat);
      ++k;
    }
  }
  torch::Tensor grad = torch::empty({rows}, torch::kFloat);
  for (int64_t i = 0; i < rows; ++i) grad[i] = ((11 * i + seed) % 7 - 3) / 8.0;
  g.per_token_grad = grad;
  return g;
}

rh::StepSpec Spec(const json& call, const std::map<std::string, std::string>& handles) {
  rh::StepSpec spec;
  spec.head_id = call["head_id"];
  const json o = call.value("options", json::object());
  spec.function = o.value("function", spec.function);
  if (o.contains("params")) spec.params = o["params"].get<std::map<std::string, double>>();
  if (o.contains("reduction")) spec.reduction = ReductionOf(o["reduction"]);
  spec.ignore_index = o.value("ignore_index", spec.ignore_index);
  if (o.contains("normalizer")) spec.normalizer = o["normalizer"].get<double>();
  if (o.contains("valid_tokens")) spec.valid_tokens = o["valid_tokens"].get<int64_t>();
  spec.chunk_rows = o.value("chunk_rows", spec.chunk_rows);
  spec.memory_budget_bytes = o.value("memory_budget_bytes", spec.memory_budget_bytes);
  spec.upstream_scale = o.value("upstream_scale", spec.upstream_scale);
  spec.accumulate_weight_grad = o.value("accumulate", spec.accumulate_weight_grad);
  if (o.contains("gradient_id")) {
    const json& id = o["gradient_id"];
    spec.gradient_id =
        rh::GradientId{id[0].get<std::string>(), id[1].get<int64_t>(), id[2].get<int64_t>()};
  }
  if (o.contains("expected_weight_version")) {
    spec.expected_weight_version = o["expected_weight_version"].get<int64_t>();
  }
  if (o.contains("wire_dtype")) spec.wire_dtype = Dtype(o["wire_dtype"]);
  if (o.contains("logits_dtype")) spec.logits_dtype = Dtype(o["logits_dtype"]);
  spec.retain_inputs_seconds = o.value("retain_inputs_seconds", spec.retain_inputs_seconds);
  spec.inputs_handle = o.value("inputs_handle", spec.inputs_handle);
  spec.compact_rows = o.value("compact_rows", spec.compact_rows);
  if (o.contains("token_extras"))
    spec.token_extras = o["token_extras"].get<std::vector<std::string>>();
  if (call.contains("inputs_handle_from")) {
    spec.inputs_handle = handles.at(call["inputs_handle_from"].get<std::string>());
  }
  return spec;
}

json Flat(const torch::Tensor& t) {
  if (!t.defined()) return nullptr;
  const torch::Tensor d = t.to(torch::kDouble).contiguous().reshape({-1});
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

json Extras(const rh::TokenExtras& extras) {
  json out = json::object();
  for (const auto& [name, values] : extras) out[name] = Flat(values);
  return out;
}

json Summary(const rh::StepSummary& s) {
  return {{"loss", s.loss},
          {"valid_tokens", s.valid_tokens},
          {"denominator", s.denominator},
          {"extras", s.extras},
          {"weight_version", s.weight_version},
          {"replayed", s.replayed},
          {"chunk_rows", s.chunk_rows},
          {"num_chunks", s.num_chunks},
          {"inputs_handle", s.inputs_handle}};
}

json Info(const rh::HeadInfo& info) {
  return {{"head_id", info.head_id},
          {"vocab_size", info.vocab_size},
          {"hidden_size", info.hidden_size},
          {"dtype", DtypeName(info.dtype)},
          {"has_bias", info.has_bias},
          {"device", info.device},
          {"weight_version", info.weight_version},
          {"accumulated_micro_batches", info.accumulated_micro_batches}};
}

json Error(const absl::Status& status) {
  const remotehead::core::ErrorReason why = remotehead::core::ReasonOf(status);
  return {{"ok", false},
          {"code", absl::StatusCodeToString(status.code())},
          {"message", std::string(status.message())},
          {"reason", why.reason},
          {"metadata", why.metadata}};
}

// One call of the file; `handles` collects the Forwards' inputs handles by call name.
json Run(const json& call, rh::Client& client, std::map<std::string, std::string>& handles) {
  const std::string rpc = call["rpc"];
  const std::string head_id = call["head_id"];
  json result = {{"ok", true}};
  if (rpc == "CreateHead") {
    const rh::InitSpec init{.vocab_size = call["vocab_size"].get<int64_t>(),
                            .hidden_size = call["hidden_size"].get<int64_t>(),
                            .bias = call["bias"].get<bool>(),
                            .seed = call["seed"].get<uint64_t>(),
                            .dtype = Dtype(call["dtype"].get<std::string>())};
    auto info = client.CreateHead(head_id, init);
    if (!info.ok()) return Error(info.status());
    result["info"] = Info(*info);
  } else if (rpc == "OptimizerStep") {  // SGD, unsynchronized
    rh::OptimizerStepOptions options;
    options.optimizer = rh::Sgd{.lr = call["lr"].get<double>()};
    options.zero_gradients = call.value("zero_gradients", false);
    auto info = client.OptimizerStep(head_id, options);
    if (!info.ok()) return Error(info.status());
    result["info"] = Info(*info);
  } else if (rpc == "DropHead") {
    const absl::Status status = client.DropHead(head_id);
    if (!status.ok()) return Error(status);
  } else if (rpc == "FetchGradients") {
    auto grads = client.FetchGradients(head_id);
    if (!grads.ok()) return Error(grads.status());
    result["weight_grad"] = Flat(grads->weight_grad);
    result["bias_grad"] = Flat(grads->bias_grad);
    result["info"] = Info(grads->info);
  } else {
    const rh::StepSpec spec = Spec(call, handles);
    const GeneratedInputs g = Generate(call["inputs"]);
    if (rpc == "ForwardBackward") {
      auto r = client.ForwardBackward(spec, g.inputs);
      if (!r.ok()) return Error(r.status());
      result["loss"] = r->loss;
      result["grad_hidden"] = Flat(r->grad_hidden);
      result["outputs"] = nullptr;
      result["summary"] = Summary(r->summary);
      result["token_extras"] = Extras(r->token_extras);
    } else if (rpc == "Forward") {
      auto r = client.Forward(spec, g.inputs);
      if (!r.ok()) return Error(r.status());
      handles[call["name"].get<std::string>()] = r->summary.inputs_handle;
      result["loss"] = r->summary.loss;
      result["grad_hidden"] = nullptr;
      result["outputs"] = Flat(r->outputs);
      result["summary"] = Summary(r->summary);
      result["token_extras"] = Extras(r->token_extras);
    } else if (rpc == "Backward") {
      const json& go = call["grad_output"];
      const torch::Tensor grad_output = go.value("per_token", false)
                                            ? g.per_token_grad
                                            : torch::tensor(go["scalar"].get<double>());
      auto r = client.Backward(spec, g.inputs, grad_output);
      if (!r.ok()) return Error(r.status());
      result["loss"] = r->summary.loss;
      result["grad_hidden"] = Flat(r->grad_hidden);
      result["outputs"] = nullptr;
      result["summary"] = Summary(r->summary);
      result["token_extras"] = Extras(r->token_extras);
    } else {
      throw std::invalid_argument("unknown rpc " + rpc);
    }
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::cerr << "usage: " << argv[0] << " --target=HOST:PORT --calls=FILE --out=FILE\n";
      return 2;
    }
    flags[arg.substr(2, eq - 2)] = arg.substr(eq + 1);
  }
  for (const char* required : {"target", "calls", "out"}) {
    if (!flags.count(required)) {
      std::cerr << "--" << required << ": expected a value; got none\n";
      return 2;
    }
  }
  std::ifstream in(flags["calls"]);
  if (!in) {
    std::cerr << "--calls: cannot read " << flags["calls"] << "\n";
    return 2;
  }
  const json calls = json::parse(in)["calls"];
  // One client per chunk_bytes (a client option), all on the same target.
  std::map<int64_t, std::shared_ptr<rh::Client>> clients;
  std::map<std::string, std::string> handles;
  json results = json::array();
  for (const json& call : calls) {
    const int64_t chunk_bytes = call.value("chunk_bytes", int64_t{1} << 20);
    if (!clients.count(chunk_bytes)) {
      rh::ClientOptions options{.target = flags["target"], .chunk_bytes = chunk_bytes};
      if (flags.count("fronts")) {
        options.fronts = absl::StrSplit(flags["fronts"], ',');
        options.rank = std::stoi(flags.count("rank") ? flags["rank"] : "-1");
      }
      auto client = rh::Client::Create(options);
      if (!client.ok()) {
        std::cerr << "Client::Create: " << client.status() << "\n";
        return 2;
      }
      clients[chunk_bytes] = *client;
    }
    json result;
    try {
      result = Run(call, *clients[chunk_bytes], handles);
    } catch (const std::exception& e) {  // a malformed calls file
      std::cerr << "call " << call.value("name", "?") << ": " << e.what() << "\n";
      return 2;
    }
    result["name"] = call["name"];
    results.push_back(std::move(result));
  }
  std::ofstream out(flags["out"]);
  out << json{{"client", "cpp"}, {"calls", results}}.dump(1) << "\n";
  if (!out) {
    std::cerr << "--out: cannot write " << flags["out"] << "\n";
    return 2;
  }
  return 0;
}
