// Suffix-match draft source, compiled: the same store, lookups and drafts as the pure-Python
// `nasd_core.speculation.suffix.SuffixIndex` (see its module docstring for the algorithm), which the tests
// hold it equal to. Why compiled: a Python lookup and draft cost 6-98 us per row-step in the
// replay; at GPU step times (5-10 ms for 32 rows) that is as long as the forward itself.
//
// Storage: one flat token array (sequences separated by -1) and, per anchor length L, a hash
// chain: `heads[L]` maps a window's hash to the newest position where an L-token window with
// that hash ends, `prev[L][p]` the previous such position. Every candidate is compared token by
// token, so a hash collision can only cost a wasted comparison, never a wrong match.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kSeparator = -1;
constexpr int kNumAnchors = 5;
constexpr int kAnchorLengths[kNumAnchors] = {1, 2, 4, 8, 16};

using Tokens = std::vector<int64_t>;
// (drafted tokens, each one's probability, matched context length)
using Draft = std::tuple<std::vector<int64_t>, std::vector<double>, int64_t>;

uint64_t window_hash(const int64_t* window, int length) {
  uint64_t hash = 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(length);
  for (int i = 0; i < length; ++i) {
    hash ^= static_cast<uint64_t>(window[i]) + 0x9E3779B97F4A7C15ull + (hash << 6) + (hash >> 2);
    hash *= 0xBF58476D1CE4E5B9ull;
  }
  return hash ^ (hash >> 31);
}

class SuffixIndex {
 public:
  SuffixIndex(int64_t max_tokens, int max_match, int max_candidates)
      : max_tokens_(max_tokens), max_match_(max_match), max_candidates_(max_candidates) {}

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const Tokens& tokens() const { return tokens_; }

  // Bytes the store holds, from its containers' sizes: the token and chain arrays as allocated,
  // and each hash-chain head as a node of the map (key, value, next pointer, the allocator's
  // header) plus its bucket. An estimate of the heap in use, not a measurement of it.
  int64_t memory_bytes() const {
    constexpr int64_t kNodeBytes = sizeof(uint64_t) + sizeof(int64_t) + sizeof(void*) + 16;
    int64_t bytes = static_cast<int64_t>(tokens_.capacity() * sizeof(int64_t));
    for (int anchor = 0; anchor < kNumAnchors; ++anchor) {
      bytes += static_cast<int64_t>(prev_[anchor].capacity() * sizeof(int64_t));
      bytes += static_cast<int64_t>(heads_[anchor].size()) * kNodeBytes;
      bytes += static_cast<int64_t>(heads_[anchor].bucket_count() * sizeof(void*));
    }
    return bytes;
  }

  void add_sequence(const Tokens& sequence) {
    start_sequence();
    extend(sequence);
    enforce_budget();
  }

  void start_sequence() {
    if (!tokens_.empty() && tokens_.back() != kSeparator) append(kSeparator);
    sequence_start_ = size();
    sequence_starts_.push_back(sequence_start_);
  }

  void extend(const Tokens& sequence) {
    for (int64_t token : sequence) append(token);
  }

  // (longest stored suffix of `context`, the positions where its occurrences end, newest first)
  std::pair<int64_t, std::vector<int64_t>> match(const Tokens& context, int64_t exclude) const {
    const int64_t context_length = static_cast<int64_t>(context.size());
    std::vector<std::pair<int64_t, int64_t>> found;
    for (int anchor = kNumAnchors - 1; anchor >= 0; --anchor) {
      const int length = kAnchorLengths[anchor];
      if (context_length < length) continue;
      const auto head = heads_[anchor].find(window_hash(context.data() + context_length - length, length));
      if (head == heads_[anchor].end()) continue;
      found.clear();
      for (int64_t position = head->second; position >= 0 && static_cast<int>(found.size()) < max_candidates_;
           position = prev_[anchor][position]) {
        if (position == exclude) continue;
        const int64_t matched = extend_back(context, position);
        if (matched >= length) found.emplace_back(matched, position);
      }
      if (found.empty()) continue;
      int64_t best = 0;
      for (const auto& [matched, position] : found) best = std::max(best, matched);
      std::vector<int64_t> ends;
      for (const auto& [matched, position] : found)
        if (matched == best) ends.push_back(position);
      return {best, ends};
    }
    return {0, {}};
  }

  Draft draft(const Tokens& context, int64_t max_tokens, int64_t exclude, double max_spec_factor,
              double min_token_prob) const {
    auto [match_length, alive] = match(context, exclude);
    return draft_from(match_length, std::move(alive), max_tokens, max_spec_factor, min_token_prob);
  }

  // The draft following the occurrences `alive` (ends of a `match_length`-token match).
  Draft draft_from(int64_t match_length, std::vector<int64_t> alive, int64_t max_tokens, double max_spec_factor,
                   double min_token_prob) const {
    std::vector<int64_t> drafted;
    std::vector<double> probs;
    if (alive.empty() || max_tokens <= 0) return {drafted, probs, 0};
    // Compared as doubles: an unbounded factor (inf) must not overflow the cast.
    const double sized = std::ceil(max_spec_factor * static_cast<double>(match_length));
    const int64_t limit = sized < static_cast<double>(max_tokens) ? static_cast<int64_t>(sized) : max_tokens;
    const int64_t stored = size();
    double prob = 1.0;
    std::vector<std::pair<int64_t, int64_t>> counts;  // (token, count) in order of first sight
    for (int64_t offset = 1; offset <= limit; ++offset) {
      counts.clear();
      for (int64_t position : alive) {  // newest first: a tie keeps the most recent continuation
        if (position + offset >= stored) continue;
        const int64_t token = tokens_[position + offset];
        if (token == kSeparator) continue;
        auto seen = std::find_if(counts.begin(), counts.end(), [&](const auto& entry) { return entry.first == token; });
        if (seen == counts.end()) {
          counts.emplace_back(token, 1);
        } else {
          ++seen->second;
        }
      }
      if (counts.empty()) break;
      auto best = counts.begin();
      for (auto entry = counts.begin(); entry != counts.end(); ++entry)
        if (entry->second > best->second) best = entry;
      prob *= static_cast<double>(best->second) / static_cast<double>(alive.size());
      if (prob < min_token_prob) break;
      const int64_t token = best->first;
      drafted.push_back(token);
      probs.push_back(prob);
      std::vector<int64_t> agreeing;
      for (int64_t position : alive)
        if (position + offset < stored && tokens_[position + offset] == token) agreeing.push_back(position);
      alive.swap(agreeing);
    }
    return {drafted, probs, match_length};
  }

 private:
  void append(int64_t token) {
    const int64_t position = size();
    tokens_.push_back(token);
    for (int anchor = 0; anchor < kNumAnchors; ++anchor) {
      const int length = kAnchorLengths[anchor];
      const int64_t start = position + 1 - length;
      if (token == kSeparator || start < sequence_start_) {
        prev_[anchor].push_back(-1);
        continue;
      }
      auto [head, inserted] = heads_[anchor].try_emplace(window_hash(tokens_.data() + start, length), position);
      prev_[anchor].push_back(inserted ? -1 : head->second);
      head->second = position;
    }
  }

  int64_t extend_back(const Tokens& context, int64_t position) const {
    const int64_t context_length = static_cast<int64_t>(context.size());
    const int64_t limit = std::min<int64_t>({max_match_, context_length, position + 1});
    int64_t matched = 0;
    while (matched < limit && tokens_[position - matched] == context[context_length - 1 - matched]) ++matched;
    return matched;
  }

  // Past the budget, keep the newest sequences that fit in half of it (rebuilt: the chains
  // hold absolute positions).
  void enforce_budget() {
    if (max_tokens_ < 0 || size() <= max_tokens_) return;
    const int64_t keep_from = size() - max_tokens_ / 2;
    std::vector<Tokens> kept;
    for (size_t i = 0; i < sequence_starts_.size(); ++i) {
      const int64_t start = sequence_starts_[i];
      if (start < keep_from) continue;
      const int64_t end = i + 1 < sequence_starts_.size() ? sequence_starts_[i + 1] - 1 : size();
      kept.emplace_back(tokens_.begin() + start, tokens_.begin() + end);
    }
    tokens_.clear();
    sequence_starts_.clear();
    sequence_start_ = 0;
    for (int anchor = 0; anchor < kNumAnchors; ++anchor) {
      heads_[anchor].clear();
      prev_[anchor].clear();
    }
    for (const Tokens& sequence : kept) {
      start_sequence();
      extend(sequence);
    }
  }

  int64_t max_tokens_;  // -1: unbounded
  int max_match_;
  int max_candidates_;
  Tokens tokens_;
  std::unordered_map<uint64_t, int64_t> heads_[kNumAnchors];
  std::vector<int64_t> prev_[kNumAnchors];
  int64_t sequence_start_ = 0;
  std::vector<int64_t> sequence_starts_;
};

// One row's draft from several stores in one call (the request's own tokens, then each shared
// source's generations, newest first): the store holding the longest match drafts (a tie: the
// earlier store). With `exclude_own_end`, the first store is the request's own tokens, whose
// last position is the context's own end. Returns the draft, the match length (also when
// nothing is drafted: `max_tokens` 0 asks for the match alone) and the index of the store it
// came from (-1: no store matched).
std::tuple<std::vector<int64_t>, std::vector<double>, int64_t, int64_t> draft_best(
    const std::vector<const SuffixIndex*>& stores, const Tokens& context, int64_t max_tokens, bool exclude_own_end,
    double max_spec_factor, double min_token_prob) {
  int64_t best_length = 0;
  int64_t best_store = -1;
  std::vector<int64_t> best_alive;
  for (size_t i = 0; i < stores.size(); ++i) {
    const int64_t exclude = (i == 0 && exclude_own_end) ? stores[i]->size() - 1 : -1;
    auto [length, alive] = stores[i]->match(context, exclude);
    if (length > best_length) {
      best_length = length;
      best_store = static_cast<int64_t>(i);
      best_alive = std::move(alive);
    }
  }
  if (best_store < 0) return {{}, {}, 0, -1};
  auto [drafted, probs, length] =
      stores[best_store]->draft_from(best_length, std::move(best_alive), max_tokens, max_spec_factor, min_token_prob);
  return {drafted, probs, best_length, best_store};
}

using RowDraft = std::tuple<std::vector<int64_t>, std::vector<double>, int64_t, int64_t>;

// Every row of a step in one call: row r is `draft_best(stores[r], contexts[r], max_tokens[r], ...)`.
// One call instead of one per row: the per-call work of the binding (argument conversion, the
// interpreter's call overhead) is paid once a step, not once a row.
std::vector<RowDraft> draft_rows(
    const std::vector<std::vector<const SuffixIndex*>>& stores, const std::vector<Tokens>& contexts,
    const std::vector<int64_t>& max_tokens, bool exclude_own_end, double max_spec_factor, double min_token_prob) {
  if (stores.size() != contexts.size() || stores.size() != max_tokens.size()) {
    throw std::invalid_argument("draft_rows: stores, contexts and max_tokens differ in length");
  }
  std::vector<RowDraft> drafts;
  drafts.reserve(stores.size());
  for (size_t row = 0; row < stores.size(); ++row) {
    drafts.push_back(
        draft_best(stores[row], contexts[row], max_tokens[row], exclude_own_end, max_spec_factor, min_token_prob));
  }
  return drafts;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Suffix-match draft source (nasd_core.speculation.suffix), compiled.";
  py::class_<SuffixIndex>(module, "SuffixIndex")
      .def(py::init<int64_t, int, int>(), py::arg("max_tokens"), py::arg("max_match"), py::arg("max_candidates"))
      .def("__len__", &SuffixIndex::size)
      .def("memory_bytes", &SuffixIndex::memory_bytes)
      .def_property_readonly("tokens", &SuffixIndex::tokens)
      .def("add_sequence", &SuffixIndex::add_sequence)
      .def("start_sequence", &SuffixIndex::start_sequence)
      .def("extend", &SuffixIndex::extend)
      .def("match", &SuffixIndex::match)
      .def("draft", &SuffixIndex::draft);
  module.def("draft_rows", &draft_rows);
}
