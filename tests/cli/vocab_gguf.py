"""A model's tokenizer in a GGUF of its own (no tensors), for the reference tests
that run duet's tokenizer or chat template on variations of it (pretok_test.py,
template_test.py)."""
import gguf


def vocab_of(path):
    """(tokens, token types, merges) of a GGUF's BPE tokenizer."""
    r = gguf.GGUFReader(path)

    def strs(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    types = r.fields["tokenizer.ggml.token_type"]
    return strs("tokenizer.ggml.tokens"), [int(types.parts[i][0]) for i in types.data], strs("tokenizer.ggml.merges")


def chat_template_of(path):
    f = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def write_vocab_gguf(path, pre, tokens, types, merges, chat_template=None):
    """A GGUF holding only a gpt2-style tokenizer (BOS 1, EOS 2, no BOS added) and,
    if given, a chat template."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
