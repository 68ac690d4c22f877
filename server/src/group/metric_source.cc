#include "remotehead/server/group/metric_source.h"

namespace remotehead::server {

MetricFamilySamples OneValue(std::string name, std::string help, bool counter, double value) {
  return {.name = std::move(name),
          .help = std::move(help),
          .counter = counter,
          .samples = {{.labels = {}, .value = value}}};
}

MetricFamilySamples CollectiveBytesByOp(std::string name, std::string help,
                                        const std::map<std::string, CollectiveBytes>& moved) {
  MetricFamilySamples family{.name = std::move(name), .help = std::move(help), .counter = true};
  for (const auto& [op, b] : moved) {
    for (const auto& [direction, value] : {std::pair{"sent", b.sent}, {"received", b.received}}) {
      family.samples.push_back(
          {.labels = {{"op", op}, {"direction", direction}}, .value = static_cast<double>(value)});
    }
  }
  return family;
}

}  // namespace remotehead::server
