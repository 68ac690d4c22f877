// AdmissionController on its own: the memory budget, the active-request limit, the FIFO queue
// and its bound, reservations, and withdrawal of a queued request.
#include "remotehead/server/service/admission.h"

#include <gtest/gtest.h>

#include <vector>

namespace remotehead::server {
namespace {

TEST(AdmissionTest, AdmitsWithinBudgetAndQueuesBeyondInOrder) {
  AdmissionController admission({.memory_budget_bytes = 100, .max_active = 0, .max_queued = 4});
  std::vector<int> admitted;
  const uint64_t a = admission.NewTicket(), b = admission.NewTicket(), c = admission.NewTicket();
  ASSERT_TRUE(admission.Admit(a, 60, "a", [&] { admitted.push_back(1); }).ok());
  ASSERT_TRUE(admission.Admit(b, 50, "b", [&] { admitted.push_back(2); }).ok());
  // c fits the remaining 40 bytes but must not overtake b.
  ASSERT_TRUE(admission.Admit(c, 10, "c", [&] { admitted.push_back(3); }).ok());
  EXPECT_EQ(admitted, (std::vector<int>{1}));
  EXPECT_EQ(admission.Stats().active, 1);
  EXPECT_EQ(admission.Stats().queued, 2);
  EXPECT_EQ(admission.Stats().bytes_in_use, 60);

  admission.Release(a);
  EXPECT_EQ(admitted, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(admission.Stats().bytes_in_use, 60);
  admission.Release(b);
  admission.Release(c);
  EXPECT_EQ(admission.Stats().bytes_in_use, 0);
  EXPECT_EQ(admission.Stats().active, 0);
}

TEST(AdmissionTest, RefusesARequestLargerThanTheWholeBudget) {
  AdmissionController admission({.memory_budget_bytes = 1 << 20});
  bool called = false;
  const absl::Status s =
      admission.Admit(admission.NewTicket(), 3 << 20, "scratch dW 3 MiB", [&] { called = true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("memory budget of 1 MiB"), std::string::npos) << s;
  EXPECT_NE(s.message().find("needing 3 MiB (scratch dW 3 MiB)"), std::string::npos) << s;
  EXPECT_FALSE(called);
  EXPECT_EQ(admission.Stats().bytes_in_use, 0);
}

TEST(AdmissionTest, RefusesWhenTheQueueIsFull) {
  AdmissionController admission({.memory_budget_bytes = 0, .max_active = 1, .max_queued = 1});
  int admitted = 0;
  const uint64_t a = admission.NewTicket(), b = admission.NewTicket();
  ASSERT_TRUE(admission.Admit(a, 1, "a", [&] { ++admitted; }).ok());
  ASSERT_TRUE(admission.Admit(b, 1, "b", [&] { ++admitted; }).ok());  // queued
  const absl::Status s = admission.Admit(admission.NewTicket(), 1, "c", [&] { ++admitted; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("expected at most 1 queued requests (--max_queued_requests)"),
            std::string::npos)
      << s;
  EXPECT_EQ(admitted, 1);
  admission.Release(a);
  EXPECT_EQ(admitted, 2);
  EXPECT_EQ(admission.Stats().active, 1);
}

TEST(AdmissionTest, WithdrawingAQueuedRequestLetsTheNextOneIn) {
  AdmissionController admission({.memory_budget_bytes = 10, .max_active = 0, .max_queued = 4});
  std::vector<int> admitted;
  const uint64_t a = admission.NewTicket(), big = admission.NewTicket(),
                 small = admission.NewTicket();
  ASSERT_TRUE(admission.Admit(a, 5, "a", [&] { admitted.push_back(1); }).ok());
  ASSERT_TRUE(admission.Admit(big, 10, "big", [&] { admitted.push_back(2); }).ok());
  ASSERT_TRUE(admission.Admit(small, 5, "small", [&] { admitted.push_back(3); }).ok());
  EXPECT_EQ(admitted, (std::vector<int>{1}));
  admission.Release(big);  // e.g. the client cancelled while queued
  EXPECT_EQ(admitted, (std::vector<int>{1, 3}));
  EXPECT_EQ(admission.Stats().queued, 0);
}

TEST(AdmissionTest, ReservationsCountAgainstTheBudgetAndAreNeverQueued) {
  AdmissionController admission({.memory_budget_bytes = 10});
  const uint64_t r = admission.NewTicket();
  ASSERT_TRUE(admission.Reserve(r, 8, "retained").ok());
  const absl::Status s = admission.Reserve(admission.NewTicket(), 8, "retained");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  bool called = false;
  const uint64_t q = admission.NewTicket();
  ASSERT_TRUE(admission.Admit(q, 5, "step", [&] { called = true; }).ok());
  EXPECT_FALSE(called);  // queued behind the reservation
  EXPECT_EQ(admission.Stats().active, 0);
  admission.Release(r);
  EXPECT_TRUE(called);
  admission.Release(q);
  EXPECT_EQ(admission.Stats().bytes_in_use, 0);
}

}  // namespace
}  // namespace remotehead::server
