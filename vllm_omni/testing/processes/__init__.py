"""The processes the tests and benchmarks start and talk to: model servers (forked from one that has imported the
stack, or real ``vllm`` executables), a local Hugging Face Hub, a media server and a stand-in trainer."""
