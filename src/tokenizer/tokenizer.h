// Hugging Face `tokenizer.json` byte-level BPE, written from the format (no tokenizers library):
// normalizer, pre-tokenizer (Split with a Unicode regex + ByteLevel), BPE model with merges, added and
// special tokens, ByteLevel decoder. encode()/decode() equal HF tokenizers on the committed goldens.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chimera {

class Tokenizer {
 public:
  // Errors (kInvalidInput) name the file and the JSON field.
  static Tokenizer load(const std::filesystem::path& tokenizer_json);
  static Tokenizer from_json(const std::string& json_text, const std::string& source);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // add_special_tokens: apply the post-processor's template (e.g. prepend BOS) as HF does.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Invalid UTF-8 produced by byte tokens is replaced by U+FFFD (as HF's lossy decode); never throws
  // for ids in range; ids out of range -> kInvalidInput.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  int64_t vocab_size() const;  // model vocab + added tokens (max id + 1)
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Streaming detokenization: feed ids as they are generated, get back the text that is complete so far.
// Never splits a UTF-8 character; bytes of an unfinished character are held until it completes. The
// concatenation of every feed() and the final flush() equals decode() of all the ids.
//
// Incremental (constant work per token): each feed decodes only a window ids[prefix_, end) and takes the text
// beyond decode(ids[prefix_, read_)), the two-offset scheme of HF text-generation-inference and vLLM. Context
// tokens before read_ make decoders that treat the first token specially (Strip, a leading space) decode the
// new tokens as they do inside the sequence. The window moves on whenever its text ends on a complete
// character; while it does not (a trailing U+FFFD run, which later tokens may complete: byte-level decoding
// replaces an incomplete character by one U+FFFD, byte fallback a whole invalid run), the text before the run is
// returned and the window grows until its text ends on a complete character again. So the work per token is
// constant while the text is valid UTF-8; a stream of invalid bytes without end grows the window.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tok, bool skip_special_tokens = false);
  std::string feed(int32_t id);  // newly completed text (possibly empty)
  std::string flush();           // whatever is left (invalid bytes become U+FFFD)
  // Ids passed to Tokenizer::decode so far: the work done, linear in the number of ids fed.
  size_t decoded_ids() const { return decoded_ids_; }

 private:
  std::string decode_range(size_t begin, size_t end);
  void advance(size_t window_bytes);

  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0;           // start of the decode window
  size_t read_ = 0;             // ids before this are returned text; [prefix_, read_) is context
  size_t prefix_bytes_ = 0;     // decode(ids_[prefix_, read_)).size()
  size_t held_returned_ = 0;    // bytes beyond prefix_bytes_ of the current window already returned
  size_t decoded_ids_ = 0;
};

}  // namespace chimera
