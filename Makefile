# The two commands of README.md: `make run` and `make test`. Each installs missing
# Debian packages, fetches the default model, builds, and runs.
BUILD ?= build
JOBS ?= $(shell nproc)
MODEL ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: all deps model configure build run test bench clean

all: build

deps:
	@scripts/install-deps

model: deps
	@scripts/fetch-model

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

run: build model
	$(BUILD)/duet run --model $(MODEL) --chat -p "$(PROMPT)" --max-tokens 128

test: build model
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) -LE 'soak|fuzz'

bench: build model
	scripts/bench-vs-llama-cpp

clean:
	rm -rf $(BUILD)
