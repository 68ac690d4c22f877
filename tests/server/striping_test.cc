// A step striped over C streams (StepHeader.stripe): for C = 1, 2, 4 the same loss, dX and dW
// as on one stream and as the naive full-logits reference; results spread over the streams,
// each ending with the summary; a replay under a new key adds nothing; one cancelled stream
// fails them all and commits nothing, as does one that ends short of the rows messages it
// announced (and one that sent them all is complete without its half-close); malformed stripes
// are refused naming the field.
#include <atomic>
#include <memory>
#include <mutex>

#include "server/service_fixture.h"

namespace remotehead {
namespace {

class StripingTest : public ServiceFixture {
 protected:
  void SetUp() override { StartService({.admission = {.memory_budget_bytes = 64 << 20}}); }

  struct Striped {
    std::vector<grpc::Status> status;  // by stream
    std::vector<int64_t> dx_rows;      // dX rows each stream carried back
    std::vector<int> summaries;        // summaries each stream carried back
    torch::Tensor grad_hidden;         // assembled over all streams
    torch::Tensor covered;             // how often each row came back
    v1::StepSummary summary;           // stream 0's
  };

  // One step of StepMessages over `count` streams: stream 0 sends the header, stream i a
  // header with its stripe, row message j goes on stream j mod count. `edit(i, m)` may alter
  // (or, by clearing it, drop) stream i's messages; `cancel` cancels that stream once the step
  // runs (dX came back on some stream), while the others are held open.
  Striped StripedStep(const std::string& trainer, int64_t micro_batch, int count,
                      const std::string& key, int64_t piece = 5,
                      const std::function<void(int, v1::StepRequest&)>& edit = nullptr,
                      int cancel = -1) {
    std::vector<v1::StepRequest> messages =
        StepMessages(trainer, micro_batch, piece, Rpc::kForwardBackward);
    std::vector<std::vector<v1::StepRequest>> per_stream(count);
    for (int i = 0; i < count; ++i) {
      v1::StepRequest header;
      if (i == 0) header = messages[0];
      v1::StripeSpec* stripe = header.mutable_header()->mutable_stripe();
      stripe->set_key(key);
      stripe->set_count(count);
      stripe->set_index(i);
      per_stream[i].push_back(std::move(header));
    }
    for (size_t j = 1; j < messages.size(); ++j) {
      per_stream[(j - 1) % count].push_back(messages[j]);
    }
    if (announce_) {
      for (auto& stream : per_stream) {
        stream[0].mutable_header()->mutable_stripe()->set_messages(std::ssize(stream) - 1);
      }
    }

    Striped out;
    out.status.resize(count);
    out.dx_rows.assign(count, 0);
    out.summaries.assign(count, 0);
    out.grad_hidden = torch::full({kRows, kHidden}, NAN);
    out.covered = torch::zeros({kRows}, torch::kLong);
    std::mutex mu;
    std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
    for (int i = 0; i < count; ++i) contexts.push_back(std::make_unique<grpc::ClientContext>());
    std::atomic<bool> cancelled{false};
    std::atomic<bool> running{false};
    std::atomic<bool> ended{false};  // some stream's responses ended
    std::vector<std::thread> threads;
    for (int i = 0; i < count; ++i) {
      threads.emplace_back([&, i] {
        auto stream = stub_->ForwardBackward(contexts[i].get());
        std::thread writer([&] {
          for (v1::StepRequest& m : per_stream[i]) {
            if (edit) edit(i, m);
            if (m.part_case() == v1::StepRequest::PART_NOT_SET) continue;
            if (!stream->Write(m)) return;
          }
          if (i == cancel) {
            while (!running) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            contexts[i]->TryCancel();
            cancelled = true;
            return;
          }
          // With a stream to cancel, the others stay open until it is: the step cannot end first.
          while (cancel >= 0 && !cancelled)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          // Held open until the step has ended: complete by its announced messages alone.
          while (hold_open_ && !ended) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          stream->WritesDone();
        });
        v1::StepResponse response;
        while (stream->Read(&response)) {
          std::lock_guard<std::mutex> lock(mu);
          if (response.has_grad_hidden()) {
            const auto& chunk = response.grad_hidden();
            torch::Tensor values = *DecodeTensor(chunk.values(), "grad_hidden");
            out.grad_hidden.narrow(0, chunk.row_offset(), values.size(0)).copy_(values);
            out.covered.narrow(0, chunk.row_offset(), values.size(0)).add_(1);
            out.dx_rows[i] += values.size(0);
            running = true;
          } else if (response.has_summary()) {
            ++out.summaries[i];
            if (i == 0) out.summary = response.summary();
          }
        }
        ended = true;
        writer.join();
        out.status[i] = stream->Finish();
      });
    }
    for (std::thread& t : threads) t.join();
    return out;
  }

  bool announce_ = false;   // the streams state their rows messages (StripeSpec.messages)
  bool hold_open_ = false;  // no stream half-closes before the step has ended

  static std::string Describe(const Striped& s) {
    std::string text;
    for (size_t i = 0; i < s.status.size(); ++i) {
      absl::StrAppend(&text, " stream ", i, ": ", s.status[i].error_code(), " ",
                      s.status[i].error_message(), ";");
    }
    return text;
  }
};

TEST_F(StripingTest, EveryStreamCountGivesTheOneStreamStepAndTheReference) {
  const reference::ReferenceResult expected =
      reference::NaiveReference(testing::HeadOf(*entry_), batch_,
                                {.function = "cross_entropy", .reduction = core::Reduction::kMean});
  const StepOutcome one = Step("one-stream", 0, /*piece=*/5);
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  const torch::Tensor dw_one = HeadWeightGrad();
  torch::Tensor dw_before = dw_one;

  int micro_batch = 0;
  for (int count : {1, 2, 4}) {
    SCOPED_TRACE(absl::StrCat(count, " streams"));
    const Striped s = StripedStep("striped", micro_batch++, count, absl::StrCat("key-", count));
    for (const grpc::Status& st : s.status) ASSERT_TRUE(st.ok()) << Describe(s);
    EXPECT_FALSE(s.summary.replayed());
    EXPECT_LE(reference::RelativeError(s.summary.loss(), one.summary.loss()), 1e-6);
    EXPECT_LE(reference::RelativeError(s.summary.loss(), expected.output.item<double>()), 1e-6);
    EXPECT_EQ(s.summary.valid_tokens(), one.summary.valid_tokens());
    EXPECT_LE(reference::RelativeError(s.grad_hidden, one.grad_hidden), 1e-6);
    EXPECT_LE(reference::RelativeError(s.grad_hidden, expected.grad_hidden.to(torch::kFloat)),
              1e-5);
    // Every row came back exactly once, over the streams; each stream ended with the summary.
    EXPECT_TRUE(torch::equal(s.covered, torch::ones({kRows}, torch::kLong)));
    for (int i = 0; i < count; ++i) EXPECT_EQ(s.summaries[i], 1) << "stream " << i;
    // The step added one contribution, equal to the one-stream step's.
    const torch::Tensor dw = HeadWeightGrad();
    EXPECT_LE(reference::RelativeError(dw - dw_before, dw_one), 1e-5);
    EXPECT_LE(reference::RelativeError(dw - dw_before, expected.grad_weight.to(torch::kFloat)),
              1e-5);
    dw_before = dw;
  }
  ExpectAdmissionDrains();
}

TEST_F(StripingTest, ResultsSpreadOverTheStreams) {
  // 50 rows in 1-row messages, 4 streams: dX goes out on the stream with the fewest bytes
  // waiting, so no stream is left carrying everything.
  const Striped s = StripedStep("spread", 0, 4, "spread", /*piece=*/1);
  for (const grpc::Status& st : s.status) ASSERT_TRUE(st.ok()) << Describe(s);
  int64_t total = 0;
  for (int64_t rows : s.dx_rows) total += rows;
  EXPECT_EQ(total, kRows);
  int streams_with_rows = 0;
  for (int64_t rows : s.dx_rows) streams_with_rows += rows > 0;
  EXPECT_GE(streams_with_rows, 2) << "dX rows by stream: " << s.dx_rows[0] << " " << s.dx_rows[1]
                                  << " " << s.dx_rows[2] << " " << s.dx_rows[3];
}

TEST_F(StripingTest, AReplayUnderANewKeyAddsNothing) {
  const Striped first = StripedStep("replay", 7, 4, "first-attempt");
  for (const grpc::Status& st : first.status) ASSERT_TRUE(st.ok()) << Describe(first);
  const torch::Tensor after_first = HeadWeightGrad();
  const Striped replay = StripedStep("replay", 7, 2, "second-attempt");
  for (const grpc::Status& st : replay.status) ASSERT_TRUE(st.ok()) << Describe(replay);
  EXPECT_TRUE(replay.summary.replayed());
  EXPECT_LE(reference::RelativeError(replay.summary.loss(), first.summary.loss()), 1e-6);
  EXPECT_LE(reference::RelativeError(replay.grad_hidden, first.grad_hidden), 1e-6);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), after_first));
  // The key of an ended step names nothing any more.
  const Striped late = StripedStep("replay", 8, 4, "first-attempt");
  for (const grpc::Status& st : late.status) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(late);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "header.stripe.key")) << Describe(late);
  }
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), after_first));
}

TEST_F(StripingTest, OneCancelledStreamFailsEveryStreamAndCommitsNothing) {
  const torch::Tensor before = HeadWeightGrad();
  const Striped s = StripedStep("cancel", 3, 4, "cancel-one", 5, nullptr, /*cancel=*/2);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s.status[i].error_code(), grpc::StatusCode::CANCELLED) << Describe(s);
  }
  EXPECT_TRUE(absl::StrContains(s.status[0].error_message(), "stream 2 of 4")) << Describe(s);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before)) << "a cancelled striped step added dW";
  ExpectAdmissionDrains();
  // The retry (a new key, the same gradient id) is new work, equal to the step on one stream.
  const Striped retry = StripedStep("cancel", 3, 4, "cancel-retry");
  for (const grpc::Status& st : retry.status) ASSERT_TRUE(st.ok()) << Describe(retry);
  EXPECT_FALSE(retry.summary.replayed());
  const torch::Tensor dw_retry = HeadWeightGrad() - before;
  const StepOutcome one = Step("one-stream", 0, 5);
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  const torch::Tensor dw_one = HeadWeightGrad() - before - dw_retry;
  EXPECT_LE(reference::RelativeError(dw_retry, dw_one), 1e-5);
}

// StripeSpec.messages: a stream is complete once its announced rows messages have come — the
// step ends with every stream held open — and a stream that ends before them (its read fails,
// as at a cancellation whose notice has not yet come) fails the step CANCELLED, naming it,
// with nothing committed.
TEST_F(StripingTest, AnnouncedMessagesEndAStreamAndOneMissingFailsTheStep) {
  announce_ = true;
  hold_open_ = true;
  const torch::Tensor before = HeadWeightGrad();
  const Striped held = StripedStep("announced", 0, 3, "announced-held");
  for (const grpc::Status& st : held.status) ASSERT_TRUE(st.ok()) << Describe(held);
  EXPECT_EQ(held.summaries, std::vector<int>({1, 1, 1}));
  const torch::Tensor dw_held = HeadWeightGrad() - before;
  const StepOutcome one = Step("announced-one", 0, 5);
  ASSERT_TRUE(one.status.ok()) << one.status.error_message();
  EXPECT_LE(reference::RelativeError(dw_held, HeadWeightGrad() - before - dw_held), 1e-5);

  hold_open_ = false;
  const torch::Tensor committed = HeadWeightGrad();
  // Stream 1 half-closes one rows message short of what it announced: its last (rows 45 to 49),
  // so that no gap in the rows before it fails the step first.
  const Striped short_one =
      StripedStep("announced", 1, 2, "announced-short", 5, [](int i, v1::StepRequest& m) {
        if (i == 1 && m.has_rows() && m.rows().row_offset() == 45) m.Clear();
      });
  bool named = false;
  for (const grpc::Status& st : short_one.status) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << Describe(short_one);
    named = named || absl::StrContains(st.error_message(),
                                       "stream 1 of 2 ended after 4 of the 5 rows messages it "
                                       "announced (header.stripe.messages)");
  }
  EXPECT_TRUE(named) << Describe(short_one);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), committed))
      << "a stream short of its messages added dW";
  ExpectAdmissionDrains();
}

TEST_F(StripingTest, MalformedStripesAreRefusedNamingTheFieldAndCommitNothing) {
  const torch::Tensor before = HeadWeightGrad();
  struct Case {
    const char* what;
    std::function<void(int, v1::StepRequest&)> edit;
    grpc::StatusCode code;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"a follower that states more than its stripe",
       [](int i, v1::StepRequest& m) {
         if (i == 1 && m.has_header()) m.mutable_header()->set_head_id("lm");
       },
       grpc::StatusCode::INVALID_ARGUMENT, "header: stream 1 of a striped step states only"},
      {"streams that disagree on the count",
       [](int i, v1::StepRequest& m) {
         if (i == 1 && m.has_header()) m.mutable_header()->mutable_stripe()->set_count(3);
       },
       // Whichever stream comes first sets the count the other is held to.
       grpc::StatusCode::INVALID_ARGUMENT, "(the step's other streams); got "},
      {"an index past the count",
       [](int i, v1::StepRequest& m) {
         if (i == 1 && m.has_header()) m.mutable_header()->mutable_stripe()->set_index(2);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "header.stripe.index: expected 0 to 1"},
      {"a stream whose rows go backwards",
       [](int i, v1::StepRequest& m) {
         if (i == 0 && m.has_rows() && m.rows().row_offset() == 20) {
           m.mutable_rows()->set_row_offset(0);
         }
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "rows.row_offset: stream 0 of 2 sends its rows in "
       "increasing row_offset; got 0 after 10"},
      {"rows that no stream sent",
       [](int i, v1::StepRequest& m) {
         if (i == 1 && m.has_rows() && m.rows().row_offset() == 15) m.Clear();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "row_offset"},
      {"too many streams",
       [](int, v1::StepRequest& m) {
         if (m.has_header()) m.mutable_header()->mutable_stripe()->set_count(65);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "header.stripe.count: expected 0 to 64; got 65"},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const Striped s = StripedStep("malformed", n, 2, absl::StrCat("malformed-", n), 5, c.edit);
    ++n;
    bool named = false;
    for (const grpc::Status& st : s.status) {
      EXPECT_FALSE(st.ok()) << Describe(s);
      if (st.error_code() == c.code && absl::StrContains(st.error_message(), c.message)) {
        named = true;
      }
    }
    EXPECT_TRUE(named) << "expected " << c.message << ";" << Describe(s);
    EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
  }
  ExpectAdmissionDrains();
}

// A stream that never sends its header (lost, or cancelled before the server read it) does not
// leave the others waiting: after --stripe_join_seconds the step fails, naming it.
class StripeJoinTimeoutTest : public StripingTest {
 protected:
  void SetUp() override {
    StartService({.stripe_join_seconds = 0.5, .admission = {.memory_budget_bytes = 64 << 20}});
  }
};

TEST_F(StripeJoinTimeoutTest, AStreamThatNeverJoinsFailsTheStepAfterTheJoinWindow) {
  const torch::Tensor before = HeadWeightGrad();
  const auto start = std::chrono::steady_clock::now();
  const Striped s = StripedStep("lost", 0, 2, "lost-stream", 5, [](int i, v1::StepRequest& m) {
    if (i == 1) m.Clear();  // stream 1 of the step sends nothing at all
  });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(s.status[0].error_code(), grpc::StatusCode::ABORTED) << Describe(s);
  EXPECT_TRUE(absl::StrContains(s.status[0].error_message(),
                                "header.stripe: stream 1 of 2 did not join the striped step "
                                "within 0.5 s of its first stream"))
      << Describe(s);
  EXPECT_GE(waited, 0.5);
  EXPECT_LT(waited, 10.0);
  EXPECT_TRUE(torch::equal(HeadWeightGrad(), before));
  ExpectAdmissionDrains();
}

}  // namespace
}  // namespace remotehead
