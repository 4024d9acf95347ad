# --init-hf starts from a Hugging Face model that transformers wrote (tests/data/hugging_face), and
# --save-hf writes one: a run from the saved model starts at the same loss as a run from the
# original, on one rank and on two tensor-parallel ranks (lr 0: the weights do not move). That
# loom computes transformers' own losses is tests/unit/test_io_hugging_face's.
set(common --steps 1 --warmup 0 --lr 0 --batch 4 --seq 32 --log-every 1)
execute_process(COMMAND ${TRAIN} --init-hf ${MODEL} ${common} --save-hf ${DIR}/saved
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX MATCH "loss ([0-9.]+) -> " m "${out}")
set(original ${CMAKE_MATCH_1})
if(NOT rc EQUAL 0 OR NOT out MATCHES "loaded Hugging Face weights" OR NOT out MATCHES "saved Hugging Face model"
   OR NOT original)
  message(FATAL_ERROR "the run from ${MODEL} failed (${rc}):\n${out}\n${err}")
endif()
message(STATUS "from ${MODEL}: first loss ${original}")
execute_process(COMMAND ${TRAIN} --init-hf ${DIR}/saved ${common} --tp 2 --threads 2
                RESULT_VARIABLE rc OUTPUT_VARIABLE out2 ERROR_VARIABLE err2)
string(REGEX MATCH "loss ([0-9.]+) -> " m "${out2}")
if(NOT rc EQUAL 0 OR NOT CMAKE_MATCH_1 STREQUAL original)
  message(FATAL_ERROR "two tensor-parallel ranks from the saved model should start at loss ${original}, got (${rc}):\n${out2}\n${err2}")
endif()
execute_process(COMMAND ${TRAIN} --init-hf ${DIR}/nothing_here ${common}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out3 ERROR_VARIABLE err3)
if(rc EQUAL 0 OR NOT err3 MATCHES "loom: Hugging Face model .*not found")
  message(FATAL_ERROR "a missing model must be refused with a loom error, got (${rc}):\n${out3}\n${err3}")
endif()
