#include "stream_model.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include "weft/core/error.hpp"

namespace weft::plan::detail {

StreamModel::StreamModel(std::string slowed_stream, double overlap_slowdown)
    : slowed_name_(std::move(slowed_stream)), slowdown_(overlap_slowdown) {
  WEFT_CHECK(overlap_slowdown >= 1 && overlap_slowdown <= 100,
             "overlap_slowdown must be in [1, 100], got ", overlap_slowdown);
  WEFT_CHECK(!slowed_name_.empty() || overlap_slowdown == 1,
             "an overlap_slowdown other than 1 needs the stream it slows (slowed_stream)");
}

std::size_t StreamModel::stream_index(const std::string& name) {
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    if (streams_[s].name == name) return s;
  }
  streams_.push_back({name, name == slowed_name_, {}, -1});
  return streams_.size() - 1;
}

std::size_t StreamModel::add_job(double enqueue_us, const std::string& own_stream,
                                 const std::vector<GpuSegment>& segments,
                                 const std::vector<std::size_t>& after) {
  WEFT_CHECK(enqueue_us >= now_, "internal: a job enqueued at ", enqueue_us,
             " us, before the stream model's time ", now_, " us");
  const std::size_t id = jobs_.size();
  Job job{.enqueue_us = enqueue_us, .own = stream_index(own_stream), .first_own_item = ~Item(id)};
  bool own_seen = false;
  for (const auto& seg : segments) {
    const std::size_t s = stream_index(seg.stream);
    const Item item = Item(segments_.size());
    segments_.push_back({.job = id, .stream = s, .work_us = seg.us});
    job.segments.push_back(std::size_t(item));
    streams_[s].queue.push_back(item);
    if (s == job.own && !own_seen) {
      job.first_own_item = item;
      own_seen = true;
    }
  }
  streams_[job.own].queue.push_back(~Item(id));  // the join: the own stream busy to the job's end
  for (const std::size_t a : after) {
    WEFT_CHECK(a < id, "internal: job ", id, " waits for job ", a, ", placed after it");
    if (!jobs_[a].done) {
      ++job.waiting_for;
      jobs_[a].waiters.push_back(id);
    }
  }
  jobs_.push_back(std::move(job));
  return id;
}

std::optional<StreamModel::Item> StreamModel::front(std::size_t stream) {
  auto& queue = streams_[stream].queue;
  while (!queue.empty()) {
    const Item item = queue.front();
    const bool done = item >= 0 ? segments_[std::size_t(item)].done : jobs_[std::size_t(~item)].done;
    if (!done) return item;
    queue.pop_front();
  }
  return std::nullopt;
}

bool StreamModel::at_front(std::size_t stream, Item item) { return front(stream) == item; }

std::size_t StreamModel::job_of(Item item) const {
  return item >= 0 ? segments_[std::size_t(item)].job : std::size_t(~item);
}

bool StreamModel::can_start(const Job& job) {
  return job.enqueue_us <= now_ && job.waiting_for == 0 && at_front(job.own, job.first_own_item);
}

void StreamModel::finish_job(std::size_t id) {
  Job& job = jobs_[id];
  job.done = true;
  job.end_us = now_;
  for (const std::size_t w : job.waiters) --jobs_[w].waiting_for;
  while (first_unfinished_ < jobs_.size() && jobs_[first_unfinished_].done) ++first_unfinished_;
}

// Starts what can start now (segments of no work end at once); true if anything changed. Only
// a job with an item at the front of a stream's queue can start or go on (its next segment, or
// its join where it has no segment on its own stream), so only those are looked at.
bool StreamModel::start_ready() {
  bool changed = false;
  for (std::size_t stream = 0; stream < streams_.size(); ++stream) {
    const auto item = front(stream);
    if (!item) continue;
    const std::size_t id = job_of(*item);
    Job& job = jobs_[id];
    if (job.done) continue;
    if (!job.started) {
      if (!can_start(job)) continue;
      job.started = changed = true;
    }
    while (job.next < job.segments.size()) {
      const std::size_t s = job.segments[job.next];
      Segment& seg = segments_[s];
      if (seg.start_us >= 0 || !at_front(seg.stream, Item(s))) break;  // runs, or waits its turn
      seg.start_us = seg.since_us = now_;
      seg.left_us = seg.work_us;
      seg.end_us = now_ + seg.work_us;
      changed = true;
      if (seg.work_us > 0) {
        streams_[seg.stream].running = (long long)s;
        break;
      }
      seg.done = true;
      ++job.next;
    }
    if (job.next == job.segments.size()) finish_job(id);
  }
  return changed;
}

// The slowed stream's running segment at 1 / slowdown while another stream runs one.
void StreamModel::set_rates() {
  if (slowdown_ == 1) return;
  long long slowed = -1;
  bool others = false;
  for (const auto& stream : streams_) {
    if (stream.running < 0) continue;
    if (stream.slowed) {
      slowed = stream.running;
    } else {
      others = true;
    }
  }
  if (slowed < 0) return;
  Segment& seg = segments_[std::size_t(slowed)];
  const double rate = others ? 1 / slowdown_ : 1.0;
  if (rate == seg.rate) return;
  seg.left_us -= (now_ - seg.since_us) * seg.rate;
  seg.since_us = now_;
  seg.rate = rate;
  seg.end_us = now_ + std::max(0.0, seg.left_us) / rate;
}

// The next time anything can change: a running segment ending, or the enqueue of a job at the
// front of a stream (only such a job can start).
double StreamModel::next_event() {
  double next = std::numeric_limits<double>::infinity();
  for (std::size_t s = 0; s < streams_.size(); ++s) {
    const Stream& stream = streams_[s];
    if (stream.running >= 0) next = std::min(next, segments_[std::size_t(stream.running)].end_us);
    const auto item = front(s);
    if (!item) continue;
    const Job& job = jobs_[job_of(*item)];
    if (!job.started && job.enqueue_us > now_) next = std::min(next, job.enqueue_us);
  }
  return next;
}

void StreamModel::run_until_done(std::size_t first, std::size_t end) {
  WEFT_CHECK(first <= end && end <= jobs_.size(), "internal: jobs [", first, ", ", end,
             ") of ", jobs_.size());
  auto all_done = [&] {
    for (std::size_t id = std::max(first, first_unfinished_); id < end; ++id) {
      if (!jobs_[id].done) return false;
    }
    return true;
  };
  while (true) {
    while (start_ready()) {
    }
    set_rates();
    if (all_done()) return;
    const double next = next_event();
    WEFT_CHECK(next < std::numeric_limits<double>::infinity(),
               "internal: the stream model has jobs left and nothing that runs");
    now_ = next;
    for (auto& stream : streams_) {
      if (stream.running < 0) continue;
      Segment& seg = segments_[std::size_t(stream.running)];
      if (seg.end_us > now_) continue;
      seg.done = true;
      stream.running = -1;
      Job& job = jobs_[seg.job];
      if (++job.next == job.segments.size()) finish_job(seg.job);
    }
  }
}

std::vector<StreamModel::SegmentRun> StreamModel::segment_runs() const {
  std::vector<SegmentRun> runs;
  for (const auto& seg : segments_) {
    if (seg.done && seg.work_us > 0) {
      runs.push_back({seg.job, streams_[seg.stream].name, seg.start_us, seg.end_us});
    }
  }
  return runs;
}

}  // namespace weft::plan::detail
