// Whether the executor runs every pipeline schedule over NCCL, found on the CPU: NCCL has no tags
// (point-to-point messages between two ranks match in the order they were issued) and it runs
// every operation of a rank in order on the rank's stream, so a send holds up everything the rank
// issued after it until its receiver has posted the matching receive; only the sends and
// receives of one group (ncclGroupStart/End) progress together. StreamOrderCommunicator gives
// thread ranks exactly those rules; a schedule whose messages would match wrongly fails with the
// tags that NCCL would have mixed up, and one that would deadlock times out.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"

using namespace loom;
using namespace loom::test;

namespace {

//! Thread ranks under NCCL's ordering rules. Every operation, or group of sends and receives,
//! completes before the next starts (one stream); a send completes when its receiver has taken
//! it (rendezvous: the receiver acknowledges); sends and receives between two ranks match in
//! issue order whatever their tags, and a receive that gets a message tagged otherwise than it
//! asked throws, naming both. Within a group every send is offered before any receive waits, and
//! the group ends when its receives have arrived and its sends have been taken.
class StreamOrderCommunicator : public CollectiveInterface<StreamOrderCommunicator> {
 public:
  using loom_communicator = void;
  static constexpr bool point_to_point_in_issue_order = true;
  explicit StreamOrderCommunicator(threads::Communicator inner) : inner_(std::move(inner)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  void run(const CollectiveCall& call) {
    if (call.kind == Collective::send || call.kind == Collective::recv)
      start_group(std::span<const CollectiveCall>(&call, 1));
    else
      inner_.run(call);
  }
  //! Runs `call` to completion: the stream would not start anything after it before it ends.
  Request start(const CollectiveCall& call) {
    run(call);
    return Request();
  }
  //! Runs the group to completion.
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    check_group(calls);
    std::erase_if(acknowledgements_, [](Request& r) { return r.test(); });
    std::vector<float> tags;  // headers: each send's tag, ahead of its payload on one inner tag
    tags.reserve(calls.size());
    std::vector<Request> offered;
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::send) {
        tags.push_back(static_cast<float>(call.tag));
        offered.push_back(inner_.send_async(std::span<const float>(&tags.back(), 1), call.peer, message_tag));
        CollectiveCall payload = call;
        payload.tag = message_tag;
        offered.push_back(inner_.start(payload));
      }
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::recv) {
        float tag = 0;
        inner_.recv(std::span<float>(&tag, 1), call.peer, message_tag);
        if (static_cast<int>(tag) != call.tag)
          throw Error("stream-order recv: rank " + std::to_string(rank()) + " from rank " + std::to_string(call.peer) +
                          ": asked for the message tagged " + std::to_string(call.tag),
                      static_cast<int>(tag),
                      "NCCL would deliver this message (issued first between the two ranks) instead");
        CollectiveCall payload = call;
        payload.tag = message_tag;
        inner_.run(payload);
        // The sender takes the acknowledgement after its group's own receives: not waited for.
        acknowledgements_.push_back(inner_.send_async(std::span<const float>(&acknowledgement, 1), call.peer, ack_tag));
      }
    for (const CollectiveCall& call : calls)
      if (call.kind == Collective::send) {
        float ack = 0;
        inner_.recv(std::span<float>(&ack, 1), call.peer, ack_tag);
      }
    wait_all(offered);
    return std::vector<Request>(calls.size());
  }
  StreamOrderCommunicator split(int color, int key) { return StreamOrderCommunicator(inner_.split(color, key)); }

 private:
  static constexpr int message_tag = 0, ack_tag = 1;
  static constexpr float acknowledgement = 1;
  threads::Communicator inner_;
  std::vector<Request> acknowledgements_;  // sent, not yet taken
};
static_assert(Communicator<StreamOrderCommunicator>);

//! parity_steps steps of schedule `S` on `shape` under NCCL's rules: "" when they match one
//! rank's, else every rank's error or parity failure. A rank waiting longer than `timeout` for a
//! peer fails (a deadlock).
template <class S>
std::string stream_order_outcome(MeshShape shape, S schedule, std::chrono::milliseconds timeout) {
  using Gpt = gpt2::Model<cpu, float>;
  const Gpt global_model(pipeline_config());
  std::mutex mutex;
  std::string outcome;
  threads::run(
      shape.size(),
      [&](threads::Communicator& world) {
        std::string failure;
        try {
          StreamOrderCommunicator ordered(world.split(0, world.rank()));
          Mesh<StreamOrderCommunicator> mesh(ordered, shape);
          cpu be(1);
          Trainer<Gpt, AdamW, S, DataParallel> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                                       AdamW({.weight_decay = 0.1}), parity_lr(), pipeline_options(0.0),
                                                       DataParallel{.bucket_bytes = 4096}, schedule);
          const ParityRun run = train_steps(trainer, pipeline_global_batch, pipeline_seq);
          failure = parity_failures(trainer, run, pipeline_reference(0.0), global_model.layout());
        } catch (const std::exception& e) {
          failure = e.what();
        }
        std::lock_guard lock(mutex);
        if (!failure.empty()) outcome += "\n  rank " + std::to_string(world.rank()) + ": " + failure;
      },
      CommOptions{.timeout = timeout});
  return outcome;
}

//! A deadlock shows as a timeout: 60 s, or LOOM_TEST_STREAM_ORDER_TIMEOUT_MS.
std::chrono::milliseconds stream_order_timeout() {
  const char* ms = std::getenv("LOOM_TEST_STREAM_ORDER_TIMEOUT_MS");
  return std::chrono::milliseconds(ms != nullptr ? std::atoi(ms) : 60000);
}

}  // namespace

TEST_CASE("under NCCL's ordering rules GPipe, 1F1B and ZB-H1 train as one rank on every pipeline shape") {
  // Before the executor issued each send in one group with the next action's receive, 1F1B and
  // ZB-H1 deadlocked here: stage 0 sent micro-batch 1's activation while the last stage sent
  // micro-batch 0's gradient, each send waiting for a receive the other rank had queued behind
  // its own send.
  const auto trains_as_one_rank = [](MeshShape shape, auto schedule, std::string schedule_name) {
    CAPTURE(shape);
    CAPTURE(schedule_name);
    const std::string outcome = stream_order_outcome(shape, schedule, stream_order_timeout());
    CHECK_MESSAGE(outcome.empty(), outcome);
  };
  for (const MeshShape shape : {MeshShape{.dp = 1, .tp = 1, .pp = 2}, MeshShape{.dp = 1, .tp = 1, .pp = 4},
                                MeshShape{.dp = 2, .tp = 1, .pp = 2}, MeshShape{.dp = 1, .tp = 2, .pp = 2}}) {
    trains_as_one_rank(shape, GPipe{}, "GPipe");
    trains_as_one_rank(shape, OneFOneB{}, "1F1B");
    trains_as_one_rank(shape, ZeroBubbleH1{}, "ZB-H1");
  }
}

TEST_CASE("over NCCL's ordering rules interleaved 1F1B is refused before anything is sent") {
  // The pipeline wraps around (virtual stage 1 on rank 1 feeds stage 2 on rank 0), so two ranks
  // come to hold a gradient send to each other at once, and pairing each send with the next
  // action's receive does not cover it. The Trainer models every rank's groups first (it needs
  // no timeout to find this) and says where they would stop.
  const std::string outcome =
      stream_order_outcome(MeshShape{.dp = 1, .tp = 1, .pp = 2}, Interleaved1F1B{.virtual_stages = 2},
                           std::chrono::seconds(60));
  CHECK_MESSAGE(outcome.find("over a communicator that runs point-to-point in issue order (NCCL): got would "
                             "deadlock; rank 0 waits in {send g") != std::string::npos,
                outcome);
}

namespace {

//! Every rank's executor groups for schedule `S` on `p` ranks, `m` micro-batches, `v` chunks.
template <class S>
std::string modelled_outcome(const S& schedule, int p, std::int64_t m, int v = 1) {
  std::vector<std::vector<detail::PlannedGroup>> by_rank;
  for (int s = 0; s < p; ++s) {
    const ScheduleShape shape{.stages = p, .stage = s, .micro_batches = m, .virtual_stages = v};
    by_rank.push_back(detail::executor_groups(schedule.actions(shape), shape));
  }
  return detail::in_order_deadlock(by_rank);
}

detail::PlannedMessage message(bool send, int peer, std::int64_t micro_batch) {
  return {.send = send, .peer = peer, .direction = 0, .micro_batch = micro_batch, .to_stage = 1};
}

}  // namespace

TEST_CASE("the model of NCCL's rules agrees with the emulation: GPipe, 1F1B, ZB-H1 safe, interleaved not") {
  for (int p : {2, 3, 4, 8})
    for (std::int64_t m : {std::int64_t{1}, std::int64_t{p}, std::int64_t{2 * p + 1}, std::int64_t{4 * p}}) {
      CAPTURE(p);
      CAPTURE(m);
      CHECK(modelled_outcome(GPipe{}, p, m).empty());
      CHECK(modelled_outcome(OneFOneB{}, p, m).empty());
      CHECK(modelled_outcome(ZeroBubbleH1{}, p, m).empty());
    }
  for (int p : {2, 4})
    for (int v : {2, 3}) {
      CAPTURE(p);
      CAPTURE(v);
      const std::string why = modelled_outcome(Interleaved1F1B{.virtual_stages = v}, p, 2 * p, v);
      CHECK_MESSAGE(why.find("waits in {") != std::string::npos, why);
    }
}

TEST_CASE("the model of NCCL's rules finds crossed sends, messages out of order, and unmatched ones") {
  using Groups = std::vector<std::vector<detail::PlannedGroup>>;
  // Each rank sends to the other first, alone: both wait.
  const Groups crossed{{{message(true, 1, 0)}, {message(false, 1, 0)}}, {{message(true, 0, 0)}, {message(false, 0, 0)}}};
  CHECK(detail::in_order_deadlock(crossed) ==
        "rank 0 waits in {send a0 for stage 1 to rank 1}; rank 1 waits in {send a0 for stage 1 to rank 0}");
  // The same as one group on each rank: both complete.
  const Groups grouped{{{message(true, 1, 0), message(false, 1, 0)}}, {{message(false, 0, 0), message(true, 0, 0)}}};
  CHECK(detail::in_order_deadlock(grouped).empty());
  // Sent 0 then 1, received 1 then 0: without tags the first receive gets message 0.
  const Groups swapped{{{message(true, 1, 0)}, {message(true, 1, 1)}}, {{message(false, 0, 1)}, {message(false, 0, 0)}}};
  CHECK(detail::in_order_deadlock(swapped) ==
        "rank 1: recv a1 for stage 1 from rank 0 would get rank 0's send a0 for stage 1 to rank 1 (sent in that order, "
        "and point-to-point has no tags)");
  const Groups unmatched{{{message(true, 1, 0)}}, {}};
  CHECK(detail::in_order_deadlock(unmatched) == "rank 0: send a0 for stage 1 to rank 1 is never received");
}
