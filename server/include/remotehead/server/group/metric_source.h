// What the transport shows at scrape time, as metric families of plain values. The server's
// metrics (metrics.h) render every source's families without knowing what a group or a mesh
// is; HeadGroup and HeadMesh are the sources (their families are listed in docs/metrics.md).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "remotehead/server/group/process_group.h"

namespace remotehead::server {

struct MetricSample {
  std::vector<std::pair<std::string, std::string>> labels;
  double value = 0;
};

struct MetricFamilySamples {
  std::string name;
  std::string help;
  bool counter = false;  // a counter; a gauge otherwise
  std::vector<MetricSample> samples;
};

class MetricSource {
 public:
  virtual ~MetricSource() = default;
  // The families as they are now (called at every scrape, from the scraping thread).
  virtual std::vector<MetricFamilySamples> Metrics() const = 0;
};

// One family of one unlabelled value.
MetricFamilySamples OneValue(std::string name, std::string help, bool counter, double value);
// Bytes a rank's collectives sent and received, by operation and direction (a counter).
MetricFamilySamples CollectiveBytesByOp(std::string name, std::string help,
                                        const std::map<std::string, CollectiveBytes>& moved);

}  // namespace remotehead::server
