// The GPU side of weft::plan::simulate: the work that task bodies enqueue, run on FIFO streams.
//
// A job is one task run's GPU work: segments that run one after another, each on its stream,
// none before the job's body has enqueued it (enqueue_us) and its stream-wait producers (other
// jobs) have finished. Order on a stream is the order of placement (add_job): a segment starts
// only when everything placed earlier on its stream has finished, and a job's first segment only
// when its own stream is free (everything placed earlier there, side-stream work of earlier jobs
// of that stream included: a job's side streams join back into its own stream, which stays busy
// until the job's last segment ends).
//
// The overlap slowdown: a segment on the slowed stream progresses at 1 / overlap_slowdown of its
// speed while a segment of any other stream runs (a concurrent kernel holds SMs its kernels would
// use), at full speed otherwise. With a slowdown of 1 every segment takes exactly its cost.
//
// Time advances only as far as asked (run_until_done), so that jobs can be added while earlier
// ones are still running, as long as none is enqueued before the model's current time.
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "weft/plan/cost_model.hpp"

namespace weft::plan::detail {

class StreamModel {
 public:
  // overlap_slowdown in [1, 100]; slowed_stream may be empty only with a slowdown of 1.
  StreamModel(std::string slowed_stream, double overlap_slowdown);

  // Places a job; returns its id (ids count up from 0). after: ids of jobs it waits for.
  // enqueue_us must not be before the time the model has run to.
  std::size_t add_job(double enqueue_us, const std::string& own_stream,
                      const std::vector<GpuSegment>& segments, const std::vector<std::size_t>& after);

  // Runs until every job in [first, end) has finished.
  void run_until_done(std::size_t first, std::size_t end);

  // When the job finished (after run_until_done covered it).
  double job_end(std::size_t job) const { return jobs_[job].end_us; }

  struct SegmentRun {
    std::size_t job;
    std::string stream;
    double start_us;
    double end_us;
  };
  // Every segment of positive cost that has run, in the order the segments were placed.
  std::vector<SegmentRun> segment_runs() const;

 private:
  struct Segment {
    std::size_t job;
    std::size_t stream;
    double work_us;    // its cost at full speed
    double start_us = -1;
    double end_us = -1;  // while it runs: when it would end at its current speed
    double left_us = 0;  // work left at since_us
    double since_us = 0;
    double rate = 1;
    bool done = false;
  };
  // A stream's queue holds segments (>= 0) and the joins of jobs whose own stream it is
  // (~job), in placement order.
  using Item = long long;
  struct Job {
    double enqueue_us;
    std::size_t own;
    std::vector<std::size_t> segments;
    std::size_t next = 0;  // its segment that runs or runs next
    std::size_t waiting_for = 0;  // producer jobs not finished yet
    std::vector<std::size_t> waiters;
    Item first_own_item;  // its first item in its own stream's queue
    bool started = false;
    bool done = false;
    double end_us = -1;
  };
  struct Stream {
    std::string name;
    bool slowed;  // the overlap slowdown's stream
    std::deque<Item> queue;
    long long running = -1;  // the segment that runs on it
  };

  std::size_t stream_index(const std::string& name);
  // The first unfinished item of a stream's queue (finished ones are dropped).
  std::optional<Item> front(std::size_t stream);
  bool at_front(std::size_t stream, Item item);
  std::size_t job_of(Item item) const;
  bool can_start(const Job& job);
  bool start_ready();
  void finish_job(std::size_t job);
  void set_rates();
  double next_event();

  std::string slowed_name_;
  double slowdown_;
  std::vector<Stream> streams_;
  std::vector<Job> jobs_;
  std::vector<Segment> segments_;
  std::size_t first_unfinished_ = 0;  // jobs before it have all finished
  double now_ = 0;
};

}  // namespace weft::plan::detail
